"""Dtypes by config name and the device a worker rank computes on, for every worker kind."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

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


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (the message names the call and its CUresult)."""


@functools.cache
def _libcuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    return lib


def allocation_range(ptr: int, device: torch.device) -> tuple[int, int]:
    """(base, size) of the device allocation that address ``ptr`` lies in
    (``cuMemGetAddressRange``): bytes between two addresses of one such range can be copied in
    one call, across two they cannot, even where the ranges meet."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(device):  # the driver API acts on the current context
        code = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if code != 0:
        raise CudaDriverError(f"cuMemGetAddressRange failed with CUresult {code}")
    return base.value, size.value


def reserve_segment(device: torch.device, num_bytes: int) -> None:
    """Grow the caching allocator by one segment of ``num_bytes``; later allocations split it."""
    if num_bytes > 0:
        torch.empty(num_bytes, dtype=torch.uint8, device=device)  # freed at once, kept cached
