"""Live refits: which tensors the receivers read where the sender holds them, planned once.

A *live* refit sends tensors that exist before it starts and stay where they are until it ends
(a trainer's own parameters: ``prepare(metadata, live_tensors)``). On CUDA a colocated receiver
can copy them straight out of the sender's memory, one copy per byte instead of two (pack, then
unpack). ``plan_runs`` works out, in ``prepare()``, the *runs* of every bucket: tensors of the
stream that lie back to back in one allocation of the sender (a *segment*), named by first
tensor, count, segment and offset. They travel in the spec; whatever no run covers is packed as
in any refit. A trainer after ``onload()`` lays its parameters out back to back
(``tensors.device_copies``), so a bucket is one run.

Nothing here touches a device API: the sender's allocations are found through ``locate`` and
the receiver's mappings through ``segment``, both given by the transport (``cuda``). Planning
and reading are therefore tested on the CPU, with a tensor's storage standing in for a segment.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.tensors.copies import TargetRuns
from tandem.weight_sync.buckets import Bucket, BucketPlan, Piece


@dataclass(frozen=True)
class Run:
    """Tensors ``first .. first + count - 1`` of the stream, back to back from byte ``offset``
    of the sender's segment ``segment``."""

    first: int
    count: int
    segment: int
    offset: int

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.count)


BucketRuns = tuple[Run, ...]

Locate = Callable[[torch.Tensor], "tuple[int, int, int] | None"]
"""Sender side: (segment id, offset of the tensor's first byte in it, segment size) of a
contiguous tensor, or None when the receivers cannot read it in place."""


def plan_runs(
    plan: BucketPlan, tensors: Sequence[torch.Tensor], locate: Locate
) -> tuple[BucketRuns, ...]:
    """The runs of every bucket of ``plan`` when ``tensors`` (in stream order) are sent.

    A run grows while the next tensor of the bucket starts where the run ends, inside the run's
    segment (one pointer comparison); any other tensor is looked up with ``locate``. A tensor
    that is not contiguous, or that ``locate`` rejects, is packed. A tensor split over buckets
    starts a run in each (a run always names whole tensors)."""
    planned: list[BucketRuns] = []
    for bucket in plan.buckets:
        runs: list[Run] = []
        first = count = segment = offset = 0
        next_ptr = end = -1  # of the open run: where its next tensor must start; segment end
        for piece in bucket.pieces:
            index, tensor = piece.tensor_index, tensors[piece.tensor_index]
            ptr = tensor.data_ptr()
            if (
                count
                and index == first + count
                and ptr == next_ptr
                and ptr + piece.tensor_bytes <= end
                and tensor.is_contiguous()
            ):
                count += 1
            else:
                found = locate(tensor) if tensor.is_contiguous() else None
                if found is None:
                    continue  # packed; the open run cannot grow past it
                if count:
                    runs.append(Run(first, count, segment, offset))
                (segment, offset, size), first, count = found, index, 1
                end = ptr - offset + size
            next_ptr = ptr + piece.tensor_bytes
        if count:
            runs.append(Run(first, count, segment, offset))
        planned.append(tuple(runs))
    return tuple(planned)


def run_indices(runs: BucketRuns) -> frozenset[int]:
    return frozenset(i for run in runs for i in run.indices)


def packed_pieces(plan: BucketPlan, runs: tuple[BucketRuns, ...]) -> tuple[tuple[Piece, ...], ...]:
    """Per bucket, the pieces that are packed: those no run covers (all without runs)."""
    if not runs:
        return tuple(bucket.pieces for bucket in plan.buckets)
    packed = []
    for bucket, bucket_runs in zip(plan.buckets, runs, strict=True):
        shared = run_indices(bucket_runs)
        packed.append(tuple(p for p in bucket.pieces if p.tensor_index not in shared))
    return tuple(packed)


def in_place_bytes(plan: BucketPlan, runs: tuple[BucketRuns, ...]) -> int:
    """Bytes of the stream the receivers read in place (not packed)."""
    packed = sum(p.num_bytes for pieces in packed_pieces(plan, runs) for p in pieces)
    return plan.total_bytes - packed


def ready_batches(packed: Sequence[Sequence[Piece]]) -> tuple[range, ...]:
    """The buckets whose "ready" signals are set together: a bucket that packs a piece starts a
    batch (the sender must pack it first), the buckets read wholly in place after it join that
    batch (nothing to wait for). A refit read wholly in place is one batch, announced as
    ``send()`` starts; a packed refit is one batch per bucket."""
    if not packed:
        return ()
    starts = [i for i, pieces in enumerate(packed) if pieces or i == 0]
    return tuple(range(a, b) for a, b in zip(starts, [*starts[1:], len(packed)], strict=True))


@functools.cache
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


class InPlaceReader:
    """Receiver side: the tensors of a bucket's runs, read from the sender's segments as
    ``segment(id)`` maps them (a uint8 tensor over the segment's bytes)."""

    def __init__(self, plan: BucketPlan, segment: Callable[[int], torch.Tensor]) -> None:
        self._plan = plan
        self._segment = segment
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # a segment as a dtype

    def views(self, runs: BucketRuns, indices: Sequence[int]) -> dict[int, torch.Tensor]:
        """Tensors ``indices`` (covered by ``runs``) where the sender holds them: one view per
        segment and dtype, then one ``as_strided`` per tensor."""
        located: dict[int, tuple[int, int]] = {}
        sizes = self._plan.sizes
        for run in runs:
            offset = run.offset
            for i in run.indices:
                located[i] = (run.segment, offset)
                offset += sizes[i]
        views = {}
        for index in indices:
            meta = self._plan.tensors[index]
            segment, offset = located[index]
            typed = self._typed.get((segment, meta.dtype))
            if typed is None:
                raw = self._segment(segment)
                typed = raw[: raw.numel() - raw.numel() % meta.dtype.itemsize].view(meta.dtype)
                self._typed[(segment, meta.dtype)] = typed
            strides = _contiguous_strides(meta.shape)
            views[index] = typed.as_strided(meta.shape, strides, offset // meta.dtype.itemsize)
        return views

    def copy(self, runs: BucketRuns, bucket: Bucket, targets: TargetRuns) -> int:
        """Copy the tensors of ``runs`` that ``bucket`` completes into ``targets``, a byte copy
        per run of targets; returns the number of copies."""
        copies, last = 0, bucket.pieces[-1]
        for run in runs:
            end = run.first + run.count
            if end - 1 == last.tensor_index and not last.is_last:
                end -= 1  # a split tensor whose last piece is still to come: copied then
            num_bytes = targets.starts[end] - targets.starts[run.first]  # plan sizes (checked)
            source = self._segment(run.segment)[run.offset : run.offset + num_bytes]
            copies += targets.copy(run.first, end, source)
        return copies

    def clear(self) -> None:
        """Drop the views of the segments (before they are unmapped)."""
        self._typed = {}
