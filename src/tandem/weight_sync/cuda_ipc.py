"""CUDA IPC of whole allocations through the driver API: how a colocated refit on CUDA shares
its bucket buffers and the live tensors it lets receivers read in place.

torch shares CUDA memory per storage (``reduce_tensor``): each shared tensor costs the receiver
a handle to open and close whatever its size (more than copying a small tensor takes; figures:
docs/benchmarks/2026-12-03-gpu-refit-offload-mfu.md), torch re-wraps the storage of
every tensor it shares, and a shared block stays allocated until the receiver has rebuilt *and*
released it — a receiver that never maps it leaks it. A trainer's parameters after ``onload()``
are carved from a handful of allocator segments, so the refit shares *segments* instead: the
sender finds the allocation a tensor lives in (``devices.allocation_range``) and exports it once;
the receiver maps it on first use and reads every tensor at its offset, and unmaps it before
the sender may free it. libcuda is the driver every CUDA process has loaded; nothing here
allocates.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from tandem.tensors.devices import CudaDriverError, allocation_range, device_bytes

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class CudaIpcError(RuntimeError):
    """A driver call of the in-place path failed (the message names the call and the code)."""


@functools.cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    return lib


def _check(code: int, call: str) -> None:
    if code != 0:
        raise CudaIpcError(f"{call} failed with CUresult {code}")


@dataclass(frozen=True)
class Segment:
    """One allocation of the sender: its base address, size and IPC handle."""

    base: int
    size: int
    handle: bytes


class SegmentTable:
    """Sender side: the segments the tensors of one refit live in, each exported once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bases: list[int] = []  # sorted
        self._segments: list[Segment] = []  # in the order of _bases
        self.ids: dict[int, int] = {}
        """base -> segment id, in the order segments were first exported."""
        self.by_id: list[Segment] = []

    def locate(self, ptr: int) -> tuple[int, int, bool]:
        """(segment id, offset of ``ptr`` in it, whether the segment is new to this table)."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            segment = self._segments[i]
            if ptr < segment.base + segment.size:
                return self.ids[segment.base], ptr - segment.base, False
        try:
            base, size = allocation_range(ptr, self.device)
        except CudaDriverError as error:
            raise CudaIpcError(str(error)) from error
        handle = _Handle()
        with torch.cuda.device(self.device):  # the driver API acts on the current context
            _check(_driver().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        segment = Segment(base, size, bytes(handle.reserved))
        i = bisect.bisect_right(self._bases, segment.base)
        self._bases.insert(i, segment.base)
        self._segments.insert(i, segment)
        self.ids[segment.base] = len(self.by_id)
        self.by_id.append(segment)
        return self.ids[segment.base], ptr - segment.base, True


def open_segment(handle: bytes, size: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """Map a sender's segment: (the pointer to close later, a uint8 tensor over its bytes)."""
    raw = _Handle.from_buffer_copy(handle)
    ptr = ctypes.c_uint64()
    with torch.cuda.device(device):
        _check(
            _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS),
            "cuIpcOpenMemHandle",
        )
        return ptr.value, device_bytes(ptr.value, size, device)


def close_segment(ptr: int, device: torch.device) -> None:
    """Unmap what ``open_segment`` mapped (every view of it must be gone or unused)."""
    with torch.cuda.device(device):
        _check(_driver().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
