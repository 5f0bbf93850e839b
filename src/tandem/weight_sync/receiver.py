"""A generator worker's end of a refit: the receive loop every transport shares, and the three
ways a consumer takes the weights (``iter_weights``, ``iter_buckets``, ``copy_into``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence

import torch

from tandem.tensors.copies import TargetRuns, copy_tensors
from tandem.weight_sync.base import RefitSpec
from tandem.weight_sync.buckets import Bucket, BucketPlan, check_target, unpack_bucket
from tandem.weight_sync.live import InPlaceReader, packed_pieces, run_indices


class RefitReceiver:
    """A generator worker's end of a refit.

    ``iter_weights()`` yields ``(name, tensor)`` in metadata order. A tensor that fits a bucket
    is a view into the receiver's (or the shared) bucket buffer: it is valid only until the
    iterator advances past its bucket, so consumers copy it (``param.copy_``, vLLM
    ``reload_weights``). Tensors split across buckets are yielded as owned tensors. What a live
    refit reads in place (colocated on CUDA) is yielded as views into the sender's memory,
    valid until the iterator ends: the receiver unmaps that memory then, and a view used after
    reads unmapped memory. ``copy_into(targets)`` receives straight into the consumer's
    tensors instead (no views handed out).
    """

    def __init__(self, spec: RefitSpec, device: torch.device, rank: int) -> None:
        if not 1 <= rank <= spec.num_receivers:
            raise ValueError(
                f"receiver rank={rank} is outside 1..{spec.num_receivers} (rank 0 is the trainer)"
            )
        self.spec = spec
        self.device = device
        self.rank = rank
        self._packed = packed_pieces(spec.plan, spec.runs)
        self._in_place = InPlaceReader(spec.plan, self._segment)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive the refit bucket by bucket and yield its tensors (see the class docstring)."""
        with contextlib.closing(self.iter_buckets()) as buckets:
            for batch in buckets:
                yield from batch

    def iter_buckets(self) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        """The tensors of ``iter_weights()``, one list per bucket (those the bucket completes),
        so that a consumer can batch its copies (``copy_tensors``). A list is valid until the
        next one is requested, as the views of ``iter_weights()`` are."""
        plan = self.spec.plan
        partial: dict[int, torch.Tensor] = {}
        with contextlib.closing(self._received()) as received:
            for index, bucket, buffer in received:
                runs = self.spec.bucket_runs(index)
                tensors = list(unpack_bucket(buffer, bucket, plan, partial, run_indices(runs)))
                shared = [i for i, tensor in tensors if tensor is None]
                views = self._in_place.views(runs, shared) if shared else {}
                yield [(plan.tensors[i].name, views[i] if t is None else t) for i, t in tensors]

    def copy_into(self, targets: Sequence[torch.Tensor] | TargetRuns) -> int:
        """Receive the refit into ``targets``: ``targets[i]`` takes the stream's tensor ``i``
        (``spec.plan.tensors[i]``, whose shape and dtype it must have). The copies are batched
        per bucket (``copy_tensors``); what a colocated sender shares in place is copied in runs
        straight out of its memory (``TargetRuns``), with no tensor made per parameter. A
        ``TargetRuns`` kept across refits is checked against the plan only when its key changes.
        Returns the number of copies launched; they are enqueued on the current stream."""
        plan = self.spec.plan
        found = targets if isinstance(targets, TargetRuns) else TargetRuns(targets)
        copies = 0
        partial: dict[int, torch.Tensor] = {}
        # checked once attached: a wrong target then fails the sender fast too
        with contextlib.closing(self._received(lambda: _check_targets(found, plan))) as received:
            for index, bucket, buffer in received:
                runs = self.spec.bucket_runs(index)
                if runs:
                    copies += self._in_place.copy(runs, bucket, found)
                if not self._packed[index]:
                    continue
                unpacked = unpack_bucket(buffer, bucket, plan, partial, run_indices(runs))
                pairs = [(found.tensors[i], t) for i, t in unpacked if t is not None]
                if pairs:
                    copies += copy_tensors([dst for dst, _ in pairs], [src for _, src in pairs])
        return copies

    def _received(
        self, attached: Callable[[], None] = lambda: None
    ) -> Generator[tuple[int, Bucket, torch.Tensor], None, None]:
        """Each bucket with the buffer holding its packed pieces, until the consumer asks for
        the next one; the receiver's signals around them (ends them on an early stop or an
        error too, so the sender fails fast). ``attached`` runs once the receiver has attached,
        before it waits for the first bucket."""
        completed = False
        try:
            self._begin()
            attached()
            for index, bucket in enumerate(self.spec.plan.buckets):
                yield index, bucket, self._wait_bucket(index)
                self._done_bucket(index)
            completed = True
        finally:
            # Also on GeneratorExit: a consumer that stops early must not leave the sender hanging.
            self._in_place.clear()
            self._end(completed)

    # Transport hooks.
    def _begin(self) -> None:
        """Attach to the refit (open what the sender shares, join its group)."""
        raise NotImplementedError

    def _wait_bucket(self, index: int) -> torch.Tensor:
        """Wait for bucket ``index``; the buffer that holds its packed pieces."""
        raise NotImplementedError

    def _done_bucket(self, index: int) -> None:
        """The consumer is done with bucket ``index``."""
        raise NotImplementedError

    def _end(self, completed: bool) -> None:
        """Release everything; when not ``completed``, fail the sender fast."""
        raise NotImplementedError

    def _segment(self, segment: int) -> torch.Tensor:
        """The bytes of the sender's segment ``segment``, mapped (live runs only)."""
        raise NotImplementedError(f"{type(self).__name__} reads nothing in place")


def _check_targets(targets: TargetRuns, plan: BucketPlan) -> None:
    if targets.checked == plan.key and plan.key:
        return
    if len(targets.tensors) != len(plan.tensors):
        raise ValueError(
            f"copy_into: {len(targets.tensors)} targets for a refit of {len(plan.tensors)} tensors"
        )
    for meta, target in zip(plan.tensors, targets.tensors, strict=True):
        check_target(meta, target)
    targets.checked = plan.key
