"""Offload by storage: every device storage a trainer's state lives in is copied to (pinned)
host memory and resized to 0 bytes; onload resizes it back and copies the bytes in.

Megatron-core keeps parameters and gradients as views into a few flat buffers (its DDP's
``param_data`` / ``grad_data``), the optimizer's main parameters as views or copies of them,
and parameters' ``main_grad`` as further views. Moving the storage under them, instead of
rebinding tensors, leaves every tensor object, view, offset and alias as it was (the same
objects before and after, each still viewing the same bytes): nothing that holds a reference
needs to know. Each storage is copied once, however many tensors view it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from tandem.tensors.devices import reserve_segment
from tandem.tensors.pinned import pinned_bytes

HOST_ALIGN = 4096
"""Each storage's host copy starts on a page (DMA runs fastest from aligned addresses)."""


def attribute_tensors(owner: Any) -> list[torch.Tensor]:
    """Tensors ``owner`` holds as attributes, directly or in lists (two levels deep): what an
    optimizer wrapper keeps beside its parameters (flags, shard lists)."""
    found: list[torch.Tensor] = []

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                walk(item, depth + 1)

    for value in vars(owner).values() if owner is not None else ():
        walk(value, 0)
    return found


def _by_storage(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if tensor.device == device and tensor.untyped_storage().nbytes():
            seen.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return seen


class StorageOffload:
    """The distinct device storages behind ``tensors`` (found at construction, all resident)
    and their host copies (allocated at the first ``offload``, pinned where CUDA is).
    Storages behind ``discard`` are freed and given back without their bytes (gradient
    buffers that are zeroed before use). ``previous``: an earlier instance over the same
    storages, whose host memory is reused when the sizes agree."""

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        device: torch.device,
        discard: Iterable[torch.Tensor] = (),
        previous: StorageOffload | None = None,
    ):
        self.device = device
        dropped = _by_storage(discard, device)
        kept = {k: t for k, t in _by_storage(tensors, device).items() if k not in dropped}
        self.holders = list(kept.values())
        """One tensor per kept storage: ``untyped_storage()`` of it reaches the storage."""
        self.sizes = [t.untyped_storage().nbytes() for t in self.holders]
        self.discarded = list(dropped.values())
        self.discarded_sizes = [t.untyped_storage().nbytes() for t in self.discarded]
        same = previous is not None and previous.sizes == self.sizes
        self.host: list[torch.Tensor] = previous.host if same and previous else []
        self.resident = True
        self.seconds: dict[str, float] = {}
        """The last offload's and onload's parts: ``offload_copy`` (the copies to the host,
        synchronised), ``offload_free``; ``onload_alloc`` (device memory back), ``onload_copy``."""

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def _bytes(self, holder: torch.Tensor, size: int) -> torch.Tensor:
        """A uint8 tensor over the whole storage of ``holder``."""
        view = torch.empty(0, dtype=torch.uint8, device=self.device)
        return view.set_(holder.untyped_storage(), 0, (size,), (1,))

    def offload(self) -> None:
        """Copy every storage to the host, then free its device memory (resize to 0)."""
        if not self.resident:
            return
        pin = self.device.type == "cuda"
        if not self.host:  # views of one page-locked allocation of the exact size
            starts = [0]
            for size in self.sizes:
                starts.append(starts[-1] + -(-size // HOST_ALIGN) * HOST_ALIGN)
            whole = pinned_bytes(starts[-1]) if pin else torch.empty(starts[-1], dtype=torch.uint8)
            self.host = [whole[at : at + n] for at, n in zip(starts[:-1], self.sizes, strict=True)]
        start = time.perf_counter()
        for holder, size, host in zip(self.holders, self.sizes, self.host, strict=True):
            host.copy_(self._bytes(holder, size), non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self.device)
        copied = time.perf_counter()
        for holder in self.holders + self.discarded:
            holder.untyped_storage().resize_(0)
        self.seconds["offload_copy"] = copied - start
        self.seconds["offload_free"] = time.perf_counter() - copied
        self.resident = False

    def onload(self) -> None:
        """Give every storage its bytes back and copy them in from the host."""
        if self.resident:
            return
        pin = self.device.type == "cuda"
        start = time.perf_counter()
        if pin:  # one device allocation the storages are then carved from, not one each
            reserve_segment(self.device, self.nbytes + sum(self.discarded_sizes))
        for holder, size in zip(self.holders, self.sizes, strict=True):
            holder.untyped_storage().resize_(size)
        for holder, size in zip(self.discarded, self.discarded_sizes, strict=True):
            holder.untyped_storage().resize_(size)
        allocated = time.perf_counter()
        for holder, size, host in zip(self.holders, self.sizes, self.host, strict=True):
            self._bytes(holder, size).copy_(host, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self.device)
        self.seconds["onload_alloc"] = allocated - start
        self.seconds["onload_copy"] = time.perf_counter() - allocated
        self.resident = True
