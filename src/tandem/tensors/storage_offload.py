"""Offload by storage: every device storage a trainer's state lives in is copied to (pinned)
host memory and resized to 0 bytes; onload resizes it back and copies the bytes in.

Megatron-core keeps parameters and gradients as views into a few flat buffers (its DDP's
``param_data`` / ``grad_data``), the optimizer's main parameters as views or copies of them,
and parameters' ``main_grad`` as further views. Moving the storage under them, instead of
rebinding tensors, leaves every tensor object, view, offset and alias as it was (the same
objects before and after, each still viewing the same bytes): nothing that holds a reference
needs to know. Each storage is copied once, however many tensors view it.

Storages that lie back to back on the device, as the host copy lays them out, move in one copy:
onload carves them in the host's order from segments it reserves (the large ones first, so the
caching allocator's small pool does not break the run), so from the second offload on the state
moves in a few large copies instead of one per storage. A copy never spans two device
allocations (CUDA refuses one that does, even where their addresses meet): storages join only
inside one device allocation, as the driver reports it (``devices.allocation_range``, looked up
once per allocation an offload or onload meets). The caching allocator gives a storage the
smallest free block that fits, which may lie in a segment other tensors hold rather than in the
one reserved for it: such storages still join their neighbours there. Onload reserves a chunk at
a time and starts its copies before reserving the next, so the device allocations overlap the
copies in flight.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tandem.tensors.devices import allocation_range, device_bytes, reserve_segment
from tandem.tensors.pinned import pinned_bytes

BLOCK = 512
"""The CUDA caching allocator's granularity: a storage of n bytes takes a block of n rounded up
to it. The host copy spaces storages the same way, so a run carved back to back on the device
has the host's layout."""

SMALL = 1 << 20
"""Storages of at most this many bytes come from the allocator's small pool, not the segment."""

CHUNK = 1 << 30
"""Onload reserves device memory for about this many bytes of storages at a time."""


def _blocks(size: int) -> int:
    return max(-(-size // BLOCK), 1) * BLOCK


def copy_runs(
    device_starts: list[int],
    host_starts: list[int],
    sizes: list[int],
    spans: Sequence[tuple[int, int]] = (),
) -> list[range]:
    """Index ranges of storages that move in one copy each: storage i + 1 joins i's run where
    it starts one block of i after i on the device and on the host, and both lie in one of
    ``spans`` (sorted, disjoint device address ranges, each inside one allocation). The bytes
    between them are then i's own block's padding (no other block is that small), so a copy of
    the whole span touches nothing else."""
    span_starts = [start for start, _ in spans]

    def span_of(i: int) -> int:
        at = bisect.bisect_right(span_starts, device_starts[i]) - 1
        inside = at >= 0 and device_starts[i] + sizes[i] <= spans[at][1]
        return at if inside else -1

    where = [span_of(i) for i in range(len(sizes))]
    runs: list[range] = []
    first = 0
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or not (
            device_starts[i] - device_starts[i - 1] == _blocks(sizes[i - 1])
            and host_starts[i] - host_starts[i - 1] == _blocks(sizes[i - 1])
            and where[i] >= 0
            and where[i] == where[i - 1]
        ):
            runs.append(range(first, i))
            first = i
    return runs


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


def _reused_host(previous: StorageOffload | None, sizes: list[int]) -> list[torch.Tensor | None]:
    """Per size in ``sizes`` a host copy of ``previous`` of that size (in their order, each
    taken once), or None."""
    free: dict[int, deque[torch.Tensor]] = {}
    for size, host in (
        zip(previous.sizes, previous.host, strict=True) if previous is not None else ()
    ):
        if host is not None:
            free.setdefault(size, deque()).append(host)
    return [free[size].popleft() if free.get(size) else None for size in sizes]


class StorageOffload:
    """The distinct device storages behind ``tensors`` (found at construction, all resident)
    and their host copies (allocated at the first ``offload``, pinned where CUDA is).
    Storages behind ``discard`` are freed and given back without their bytes (gradient
    buffers that are zeroed before use). ``previous``: an earlier instance over (mostly) the
    same storages, whose host memory is reused."""

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        device: torch.device,
        discard: Iterable[torch.Tensor] = (),
        previous: StorageOffload | None = None,
    ):
        if device.type == "cuda" and device.index is None:  # tensors name their device's index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        dropped = _by_storage(discard, device)
        kept = {k: t for k, t in _by_storage(tensors, device).items() if k not in dropped}
        holders = list(kept.values())
        self.holders = [t for t in holders if t.untyped_storage().nbytes() > SMALL]
        self.holders += [t for t in holders if t.untyped_storage().nbytes() <= SMALL]
        """One tensor per kept storage (``untyped_storage()`` of it reaches the storage), the
        large ones first: onload allocates them in this order."""
        self.sizes = [t.untyped_storage().nbytes() for t in self.holders]
        self.discarded = list(dropped.values())
        self.discarded_sizes = [t.untyped_storage().nbytes() for t in self.discarded]
        self.host: list[torch.Tensor | None] = _reused_host(previous, self.sizes)
        """Per storage its host copy: one of ``previous`` of the same size, in order (a storage
        set that grew pins memory for the new storages only), else allocated at ``offload``."""
        self.resident = True
        self.seconds: dict[str, float] = {}
        """The last offload's and onload's parts: ``offload_copy`` (the copies to the host,
        synchronised), ``offload_free``; ``onload_empty_cache``, ``onload_issue`` (device
        memory reserved and the copies started, chunk by chunk), ``onload_wait`` (the copies
        still in flight after that)."""
        self.copies: dict[str, int] = {}
        """How many copies the last offload and onload made (``offload``, ``onload``)."""
        self.spans: list[tuple[int, int]] = []
        """The device allocations (start, end) the storages of the last offload or onload lay
        in (sorted): each looked up once, while a live storage held it."""

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def _bytes(self, holder: torch.Tensor, size: int) -> torch.Tensor:
        """A uint8 tensor over the whole storage of ``holder``."""
        view = torch.empty(0, dtype=torch.uint8, device=self.device)
        return view.set_(holder.untyped_storage(), 0, (size,), (1,))

    def _copy(self, indices: range, to_host: bool) -> int:
        """Copy the storages ``indices`` between the device and their host copies (not
        synchronised), a run of storages back to back on both sides in one copy; the number of
        copies."""
        pin = self.device.type == "cuda"
        at = slice(indices.start, indices.stop)
        holders, sizes = self.holders[at], self.sizes[at]
        hosts = [h for h in self.host[at] if h is not None]
        if len(hosts) != len(holders):  # offload allocates them before its first copy
            raise RuntimeError("StorageOffload: a storage without its host copy")
        device_starts = [h.untyped_storage().data_ptr() for h in holders]
        host_starts = [h.data_ptr() for h in hosts]
        # only the CUDA caching allocator's blocks are known to hold nothing between them
        if pin:
            self._look_up(device_starts)
            runs = copy_runs(device_starts, host_starts, sizes, self.spans)
        else:
            runs = [range(i, i + 1) for i in range(len(sizes))]
        for run in runs:
            first, last = run[0], run[-1]
            if len(run) == 1:
                device = self._bytes(holders[first], sizes[first])
                host = hosts[first]
            else:
                span = device_starts[last] - device_starts[first] + sizes[last]
                device = device_bytes(device_starts[first], span, self.device)
                host = hosts[first].as_strided((span,), (1,))
            if to_host:
                host.copy_(device, non_blocking=pin)
            else:
                device.copy_(host, non_blocking=pin)
        return len(runs)

    def _look_up(self, device_starts: list[int]) -> None:
        """Add to ``spans`` the allocation of every address not inside one yet. An entry
        stays true while the storage it was looked up for holds its allocation: ``spans``
        starts empty at each offload and onload, whose storages stay alive throughout."""
        for start in device_starts:
            at = bisect.bisect_right(self.spans, (start, 1 << 64)) - 1
            if at < 0 or start >= self.spans[at][1]:
                base, size = allocation_range(start, self.device)
                bisect.insort(self.spans, (base, base + size))

    def _chunks(self) -> list[range]:
        """The storages in host order, cut where the large ones reach about ``CHUNK`` bytes."""
        chunks: list[range] = []
        first, total = 0, 0
        for i, size in enumerate(self.sizes):
            total += _blocks(size) if size > SMALL else 0
            if total >= CHUNK or i == len(self.sizes) - 1:
                chunks.append(range(first, i + 1))
                first, total = i + 1, 0
        return chunks

    def offload(self) -> None:
        """Copy every storage to the host, then free its device memory (resize to 0)."""
        if not self.resident:
            return
        pin = self.device.type == "cuda"
        missing = [i for i, host in enumerate(self.host) if host is None]
        if missing:  # views of one page-locked allocation of the exact size
            starts = [0]
            for i in missing:
                starts.append(starts[-1] + _blocks(self.sizes[i]))
            whole = pinned_bytes(starts[-1]) if pin else torch.empty(starts[-1], dtype=torch.uint8)
            for i, at in zip(missing, starts[:-1], strict=True):
                self.host[i] = whole[at : at + self.sizes[i]]
        start = time.perf_counter()
        self.spans = []
        self.copies["offload"] = self._copy(range(len(self.sizes)), to_host=True)
        if pin:
            torch.cuda.synchronize(self.device)
        copied = time.perf_counter()
        for holder in self.holders + self.discarded:
            holder.untyped_storage().resize_(0)
        self.seconds["offload_copy"] = copied - start
        self.seconds["offload_free"] = time.perf_counter() - copied
        self.resident = False

    def _reserve(self, sizes: Iterable[int]) -> None:
        """One device segment for the large storages of ``sizes``, allocated next in order."""
        num_bytes = sum(_blocks(size) for size in sizes if size > SMALL)
        if self.device.type == "cuda" and num_bytes:
            reserve_segment(self.device, num_bytes)

    def onload(self) -> None:
        """Give every storage its bytes back and copy them in from the host: a chunk's segment
        reserved, its storages carved from it in order and their copies started, then the next
        (the allocator takes the smallest cached block that fits, so none is cached beside it
        at the start); the discarded storages last."""
        if self.resident:
            return
        pin = self.device.type == "cuda"
        start = time.perf_counter()
        if pin:
            torch.cuda.empty_cache()
        self.spans = []
        emptied = time.perf_counter()
        self.copies["onload"] = 0
        for chunk in self._chunks():
            self._reserve(self.sizes[chunk.start : chunk.stop])
            for i in chunk:
                self.holders[i].untyped_storage().resize_(self.sizes[i])
            self.copies["onload"] += self._copy(chunk, to_host=False)
        self._reserve(self.discarded_sizes)
        for holder, size in zip(self.discarded, self.discarded_sizes, strict=True):
            holder.untyped_storage().resize_(size)
        issued = time.perf_counter()
        if pin:
            torch.cuda.synchronize(self.device)
        self.seconds["onload_empty_cache"] = emptied - start
        self.seconds["onload_issue"] = issued - emptied
        self.seconds["onload_wait"] = time.perf_counter() - issued
        self.resident = True
