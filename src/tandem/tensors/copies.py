"""Copying many tensors on a device: how they are laid out, and how a batch of them is copied.

A refit copies a few hundred tensors per bucket. One launch per copy is bound by the CPU: on a
GPU a launch costs more Python and driver time than copying a 1.5B model's median tensor takes
(figures: docs/benchmarks/2026-12-03-gpu-refit-offload-mfu.md). Two things keep the launches
few:

- ``device_copies`` lays tensors out back to back in one allocation, in order, each at an
  ``ALIGN_BYTES`` boundary: the layout of a packed bucket. ``onload()`` lays a trainer's
  parameters out this way, and ``HfGenerator`` its own.
- ``copy_tensors`` copies a run of pairs that sit back to back on both sides as one range of
  bytes, and fuses the small pairs left over into ``_foreach_copy_`` launches. Between two
  models laid out alike, or a packed bucket and such a model, a bucket is one copy.
- ``TargetRuns`` does the same from a range of bytes that holds the tensors back to back,
  with no source tensors made: how a colocated receiver reads a run of a trainer's parameters.
- ``pack_parameters`` lays parameters out with ``device_copies`` in place (each keeps its
  object), and ``span`` finds tensors laid out so: one copy of the span copies them all (how a
  LoRA trainer copies its adapters for a refit).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import nn

ALIGN_BYTES = 256
"""Where tensors start in a layout of this module (and in a refit bucket): enough for every
dtype and for vectorised copies."""

FOREACH_MAX_BYTES = 4 << 20
"""``copy_tensors`` copies tensors up to this size in fused launches (``_foreach_copy_``); a
larger one gets a copy of its own, which reaches the device's copy bandwidth where the fused
kernel does not (measured in ``bench/refit_breakdown.py``)."""


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def device_copies(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of ``tensors`` on ``device`` (non-blocking). The contiguous ones are views of one
    allocation, in order, each at an ``ALIGN_BYTES`` boundary; a strided one gets an allocation
    of its own and keeps its strides."""
    offsets, total = {}, 0
    for i, tensor in enumerate(tensors):
        if tensor.is_contiguous():
            offsets[i], total = total, total + _aligned(tensor.nbytes)
    arena = torch.empty(total, dtype=torch.uint8, device=device) if offsets else None
    copies = []
    for i, tensor in enumerate(tensors):
        if arena is not None and i in offsets:
            raw = arena[offsets[i] : offsets[i] + tensor.nbytes]
            out = raw.view(tensor.dtype).view(tensor.shape)
        else:
            out = torch.empty_like(tensor, device=device)  # keeps the strides
        copies.append(out.copy_(tensor, non_blocking=True))
    return copies


def pack_parameters(params: Sequence[torch.Tensor], device: torch.device) -> None:
    """Lay ``params``' data out back to back in one allocation on ``device``, in order
    (``device_copies``). Each parameter keeps its object (``torch.utils.swap_tensors``), so the
    modules, an optimizer and every alias follow."""
    with torch.no_grad():
        copies = device_copies([param.detach() for param in params], device)
    for param, copy in zip(params, copies, strict=True):
        torch.utils.swap_tensors(param, nn.Parameter(copy, requires_grad=param.requires_grad))


def span(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """The storage ``tensors`` lie in, from where the first starts to where the last ends, as
    one 1-D tensor of their dtype, and each tensor's element offset into it: when they are
    non-empty, contiguous, of one dtype, and in order without overlap in one storage (the gaps
    between them included: ``device_copies`` aligns each). None otherwise. One pass over the
    tensors that makes no tensor per tensor: this runs on every LoRA refit."""
    if not tensors:
        return None
    first = tensors[0]
    dtype, size = first.dtype, first.element_size()
    storage = first.untyped_storage()
    start = first.data_ptr()
    offsets, at = [], start
    for tensor in tensors:
        ptr = tensor.data_ptr()
        if ptr < at or (ptr - start) % size or not tensor.nbytes:
            return None
        if tensor.dtype != dtype or not tensor.is_contiguous():
            return None
        offsets.append((ptr - start) // size)
        at = ptr + tensor.nbytes
    if at > storage.data_ptr() + storage.nbytes():
        return None
    flat = torch.empty(0, dtype=dtype, device=first.device)
    flat.set_(storage, first.storage_offset(), ((at - start) // size,), (1,))
    return flat, offsets


def _byte_range(tensor: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """``num_bytes`` of ``tensor``'s storage from where ``tensor`` starts, as a uint8 tensor."""
    out = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    start = tensor.storage_offset() * tensor.element_size()
    return out.set_(tensor.untyped_storage(), start, (num_bytes,), (1,))


def _end_of_storage(tensor: torch.Tensor) -> int:
    storage = tensor.untyped_storage()
    return int(storage.data_ptr() + storage.nbytes())


def coalesce(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[range]:
    """The pairs of ``copy_tensors`` grouped into runs, in order: consecutive pairs form one run
    when each side is contiguous, of one shape and dtype, and starts exactly where the pair
    before it ended, inside the storage the run started in, so the run is one range of bytes on
    each side. An empty pair joins the run before it. (The storages are looked up once per run:
    this scan is on the refit's hot path.)"""
    runs: list[range] = []
    start = 0
    nexts = ends = (-1, -1)  # of the open run: where its next pair must start; its storages' ends
    for i, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        if (
            dst.dtype == src.dtype
            and dst.shape == src.shape
            and dst.is_contiguous()
            and src.is_contiguous()
        ):
            num_bytes = dst.nbytes
            if i > start and nexts[0] >= 0:
                if num_bytes == 0:
                    continue  # nothing to copy (and no address to check)
                at = (dst.data_ptr(), src.data_ptr())
                if at == nexts and at[0] + num_bytes <= ends[0] and at[1] + num_bytes <= ends[1]:
                    nexts = (at[0] + num_bytes, at[1] + num_bytes)
                    continue
            if dst.device == src.device:  # a run starts here
                nexts = (dst.data_ptr() + num_bytes, src.data_ptr() + num_bytes)
                ends = (_end_of_storage(dst), _end_of_storage(src))
            else:
                nexts = (-1, -1)
        else:
            nexts = (-1, -1)  # nothing continues this pair
        if i > start:
            runs.append(range(start, i))
        start = i
    if len(dsts) > start:
        runs.append(range(start, len(dsts)))
    return runs


def copy_tensors(
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    fused_max_bytes: int = FOREACH_MAX_BYTES,
) -> int:
    """``dst.copy_(src)`` for every pair, in few launches: a run of pairs back to back on both
    sides (``coalesce``) is one byte copy; the single pairs up to ``fused_max_bytes`` on one
    device go through one fused launch per pair of dtypes (a cast too: a generator that computes
    in another dtype than the trainer's); the rest get a copy each. Returns the number of
    launches.

    A byte copy writes the destination's storage directly, so autograd's version counter of the
    destination does not move: this is for weights being replaced, not for tensors a backward
    pass still needs."""
    Group = tuple[list[torch.Tensor], list[torch.Tensor]]
    fused: dict[tuple[torch.dtype, torch.dtype, torch.device], Group] = {}
    launches = 0
    for run in coalesce(dsts, srcs):
        dst, src = dsts[run.start], srcs[run.start]
        if len(run) > 1:
            num_bytes = sum(dsts[i].nbytes for i in run)
            _byte_range(dst, num_bytes).copy_(_byte_range(src, num_bytes))
        elif dst.nbytes <= fused_max_bytes and dst.device == src.device:
            group = fused.setdefault((dst.dtype, src.dtype, dst.device), ([], []))
            group[0].append(dst)
            group[1].append(src)
            continue
        else:
            dst.copy_(src)
        launches += 1
    for group_dsts, group_srcs in fused.values():
        torch._foreach_copy_(group_dsts, group_srcs)
    return launches + len(fused)


class TargetRuns:
    """Tensors to fill in order from bytes that hold them back to back (a weight stream), with
    the runs of them that lie back to back in one storage worked out once: filling any range of
    them is then one byte copy per run it touches, with no per-tensor work. (A colocated
    receiver fills its parameters this way from runs of a trainer's parameters.)

    A consumer whose tensors stay where they are (``HfGenerator``'s parameters) builds this once
    and passes it to every refit: ``RefitReceiver.copy_into`` then checks it against a plan only
    when the plan's key changes (``checked``)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.checked = ""
        """``BucketPlan.key`` of the last plan these tensors were checked against."""
        self.starts = [0]
        """Byte offset of every tensor in the stream's packing (and the total, last)."""
        self.run_starts: list[int] = []
        """Index of each run's first tensor; an empty tensor joins the run it falls in."""
        end = limit = -1  # of the open run: where its next tensor must start; its storage's end
        for i, tensor in enumerate(self.tensors):
            num_bytes = tensor.nbytes
            self.starts.append(self.starts[-1] + num_bytes)
            if not num_bytes:
                continue
            contiguous = tensor.is_contiguous()
            if contiguous and tensor.data_ptr() == end and end + num_bytes <= limit:
                end += num_bytes
                continue
            self.run_starts.append(i)
            end, limit = -1, -1
            if contiguous:
                end, limit = tensor.data_ptr() + num_bytes, _end_of_storage(tensor)

    def copy(self, first: int, end: int, src: torch.Tensor) -> int:
        """Fill tensors ``first .. end - 1`` from the uint8 ``src`` that holds their bytes back
        to back; returns the number of copies (one per run touched; none for empty tensors)."""
        if src.numel() != self.starts[end] - self.starts[first]:
            raise ValueError(
                f"{src.numel()} source bytes for tensors {first}..{end - 1} "
                f"({self.starts[end] - self.starts[first]} bytes)"
            )
        copies = 0
        k = bisect.bisect_right(self.run_starts, first) - 1  # the run tensor `first` is in
        lo = first
        while lo < end:
            hi = self.run_starts[k + 1] if k + 1 < len(self.run_starts) else len(self.tensors)
            hi, k = min(hi, end), k + 1
            while lo < hi and not self.tensors[lo].nbytes:
                lo += 1  # a run's bytes start at its first tensor that has any
            if lo < hi:
                dst = self.tensors[lo]
                at, num_bytes = (
                    self.starts[lo] - self.starts[first],
                    self.starts[hi] - self.starts[lo],
                )
                if dst.is_contiguous():
                    _byte_range(dst, num_bytes).copy_(src[at : at + num_bytes])
                else:  # a run of its own
                    dst.copy_(src[at : at + num_bytes].view(dst.dtype).view(dst.shape))
                copies += 1
            lo = hi
        return copies
