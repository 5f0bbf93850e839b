"""Exact-size page-locked host memory (``tensors.pinned``): the mapping outlives every tensor
over it and its CUDA registration ends only then; on a machine without CUDA, plain memory.
The registration itself runs on the GPU (tests/gpu/test_offload_gpu.py: offloaded state
``is_pinned()``)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from tandem.tensors import pinned
from tandem.tensors.pinned import pinned_bytes


def test_without_cuda_the_memory_is_plain_and_exact() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    tensor = pinned_bytes(3 * 4096 + 5)
    assert tensor.shape == (3 * 4096 + 5,) and tensor.dtype == torch.uint8
    assert pinned_bytes(0).numel() == 0


def test_the_registration_ends_after_the_last_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage keeps the mapping (the buffer it exported) alive; unregistering runs once,
    when the last view over it is gone, before the memory is unmapped."""
    unregistered: list[int] = []

    class Cudart:
        def cudaHostUnregister(self, address: int) -> Any:
            unregistered.append(address)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    memory = pinned._Registered(-1, 8192)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    address = memory.address = tensor.data_ptr()
    view = tensor[4096:4100]
    view.fill_(7)
    del memory, tensor
    gc.collect()
    assert unregistered == [] and view.tolist() == [7] * 4
    del view
    gc.collect()
    assert unregistered == [address]
