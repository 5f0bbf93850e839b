"""Dtypes by config name and the device a worker rank computes on, for every worker kind."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The torch dtype of each dtype name a config may give."""


class _DeviceBytes:
    """``__cuda_array_interface__`` of bytes at a device address, so torch views them."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def device_bytes(ptr: int, size: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``size`` bytes of CUDA memory at ``ptr``, without a copy; it owns
    nothing (whoever allocated the bytes keeps them alive while it is used)."""
    return torch.as_tensor(_DeviceBytes(ptr, size), device=device)


def default_device(rank: int = 0) -> torch.device:
    """The CUDA device of local rank ``rank`` (ranks wrap around the visible devices), else the
    CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def release_device_caches() -> None:
    """Return cached device memory: cuBLAS workspaces live in the caching allocator."""
    if not torch.cuda.is_available():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def allocator_segments(device: torch.device) -> list[tuple[int, int]]:
    """The address ranges (start, end) of the device allocations the CUDA caching allocator
    holds on ``device``, sorted: bytes within one range lie in one allocation."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sorted(
        (segment["address"], segment["address"] + segment["total_size"])
        for segment in torch.cuda.memory_snapshot()
        if segment["device"] == index
    )


def reserve_segment(device: torch.device, num_bytes: int) -> int:
    """Grow the caching allocator by one segment of ``num_bytes``; later allocations split it.
    The address of the reserved block (0 for none): ``num_bytes`` from it lie in one device
    allocation."""
    if num_bytes <= 0:
        return 0
    block = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    address = block.data_ptr()
    del block
    return address
