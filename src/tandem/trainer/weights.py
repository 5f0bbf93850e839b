"""The trainer's weights as Hugging Face named tensors, gathered one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def hf_state(lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of the persistent state, sharded DTensors under FSDP2.

    ``state_dict`` already strips the activation-checkpoint wrapper's prefix. With tied word
    embeddings the LM head is the embedding: it is left out, as in the checkpoints Hugging Face
    writes, and loaders (transformers, vLLM) re-tie it.
    """
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    for name, tensor in lm.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        yield name, tensor


def full_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor) on ``device``. A shard kept on the host by
    CPUOffloadPolicy is gathered on ``device`` so NCCL can carry it. On a one-rank mesh the
    local shard is the whole tensor: it is returned itself when it is on ``device`` (a refit
    may then read it in place), as a plain parameter is."""
    if isinstance(tensor, DTensor) and tensor.device_mesh.size() == 1:
        tensor = tensor._local_tensor
    if not isinstance(tensor, DTensor):
        return tensor.detach().to(device)
    if tensor._local_tensor.device != device:
        tensor = DTensor.from_local(
            tensor._local_tensor.to(device),
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    with torch.no_grad():
        return tensor.full_tensor()
