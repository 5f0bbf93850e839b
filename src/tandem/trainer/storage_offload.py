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

from collections.abc import Iterable

import torch


class StorageOffload:
    """The distinct device storages behind ``tensors`` (found once, at construction) and
    their host copies (allocated at the first ``offload``, pinned where CUDA is, reused)."""

    def __init__(self, tensors: Iterable[torch.Tensor], device: torch.device):
        self.device = device
        seen: dict[int, torch.Tensor] = {}
        for tensor in tensors:
            if tensor.device != device:
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = tensor
        self.holders = list(seen.values())
        """One tensor per storage: ``untyped_storage()`` of it reaches the storage."""
        self.sizes = [t.untyped_storage().nbytes() for t in self.holders]
        self.host: list[torch.Tensor] = []
        self.resident = True

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
        if not self.host:
            self.host = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in self.sizes]
        for holder, size, host in zip(self.holders, self.sizes, self.host, strict=True):
            host.copy_(self._bytes(holder, size), non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self.device)
        for holder in self.holders:
            holder.untyped_storage().resize_(0)
        self.resident = False

    def onload(self) -> None:
        """Give every storage its bytes back and copy them in from the host."""
        if self.resident:
            return
        pin = self.device.type == "cuda"
        for holder, size, host in zip(self.holders, self.sizes, self.host, strict=True):
            holder.untyped_storage().resize_(size)
            self._bytes(holder, size).copy_(host, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self.device)
        self.resident = True
