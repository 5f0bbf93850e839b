"""What every refit transport shares: the spec, the stats, the store signals and the send loop.

A transport only says how a packed bucket reaches the receivers (``_publish``), when a slot may
be packed again (``_wait_slot``) and how a receiver obtains bucket ``i`` (``_wait_bucket``); the
bucket order, the stream checks and the double buffering live here, once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from tandem.tensors.copies import TargetRuns, copy_tensors
from tandem.weight_sync.buckets import (
    Bucket,
    BucketPlan,
    Piece,
    TensorMeta,
    as_metadata,
    check_target,
    check_tensor,
    pack_piece,
    plan_buckets,
    unpack_bucket,
)

NUM_SLOTS = 2
"""Buffers that alternate: bucket i+1 is packed while bucket i is in flight."""

ABORT = b"abort:"
"""Prefix of a signal value that ends the refit on the other side with the message after it."""

Transport = Literal["colocated", "split"]


@dataclass(frozen=True)
class RefitSpec:
    """Everything a receiver needs for one refit; picklable (crosses Ray and collective_rpc)."""

    refit_id: int
    transport: Transport
    device_type: str
    """Device type of the sender's buffers ("cpu" or "cuda")."""
    plan: BucketPlan
    store_host: str
    store_port: int
    num_receivers: int
    timeout_s: float
    buffers: tuple[Any, ...] = ()
    """colocated on the CPU: the shared-memory path of the memory holding every slot. (On CUDA
    the slots are announced in the ``ready`` signal of the first bucket that packs a tensor.)"""
    events: tuple[bytes, ...] = ()
    """colocated on CUDA: per slot, the IPC handle of the event recorded when it is packed."""
    segments: tuple[tuple[int, str, int], ...] = ()
    """colocated on CUDA: allocations of the sender's live tensors, known at ``prepare()``, that
    the receivers map as they attach, before the first bucket (id, IPC handle hex, bytes)."""
    group_generation: int = 0
    """split: which process group to join (a new one after a failed refit)."""


@dataclass(frozen=True)
class SendStats:
    """What one ``send()`` moved and how fast."""

    seconds: float
    num_bytes: int
    num_buckets: int
    attach_seconds: float = 0.0
    """Of ``seconds``: waiting for the receivers to join (open buffers, form the group)."""
    finish_seconds: float = 0.0
    """Of ``seconds``: after the last bucket, until every receiver is done and buffers are freed."""
    in_place_bytes: int = 0
    """Of ``num_bytes``: what the receivers read where the sender holds it (not packed)."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "seconds": self.seconds,
            "bytes": float(self.num_bytes),
            "gb_per_s": self.gb_per_s,
            "num_buckets": float(self.num_buckets),
            "attach_seconds": self.attach_seconds,
            "finish_seconds": self.finish_seconds,
            "in_place_bytes": float(self.in_place_bytes),
        }


def slot_layout(plan: BucketPlan) -> tuple[int, int]:
    """(bytes of one slot, number of slots): a slot holds the largest bucket of ``plan``."""
    size = max((bucket.used_bytes for bucket in plan.buckets), default=0)
    return size, min(NUM_SLOTS, len(plan.buckets))


class RefitError(RuntimeError):
    """A refit failed on the other side or timed out (e.g. a generator worker died)."""


_CLIENT_STORES: dict[tuple[str, int], dist.TCPStore] = {}


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the sender's store, cached per process (one-time setup across refits)."""
    key = (host, port)
    if key not in _CLIENT_STORES:
        _CLIENT_STORES[key] = dist.TCPStore(
            host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False
        )
    return _CLIENT_STORES[key]


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A standalone store on a free port (not the trainer's default group)."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def wait_signals(store: dist.Store, keys: list[str], timeout_s: float, what: str) -> list[bytes]:
    """Wait for ``keys`` and return their values (one round trip: ``multi_get`` waits up to the
    store's timeout, ``timeout_s``); raise RefitError naming ``what`` on timeout or an abort."""
    try:
        values = store.multi_get(keys)
    except dist.DistStoreError as error:
        raise RefitError(
            f"refit timed out after {timeout_s:.0f} s waiting for {what}; a generator worker or "
            f"the trainer probably died or stopped consuming (keys {keys[:4]})"
        ) from error
    for value in values:
        if value.startswith(ABORT):
            raise RefitError(f"refit aborted by the other side: {value[len(ABORT) :].decode()}")
    return values


def abort_signal(message: str) -> str:
    return ABORT.decode() + message[:2000]


def set_signals(store: dist.Store, keys: list[str], values: str | list[str]) -> None:
    """Set ``keys`` to ``values`` (one value for every key, or one each) in one round trip."""
    if isinstance(values, str):
        values = [values] * len(keys)
    store.multi_set(keys, values)  # type: ignore[attr-defined]  # (not in torch's stubs)


class _StreamCursor:
    """Pulls the weight stream in metadata order and checks every tensor against it."""

    def __init__(self, plan: BucketPlan, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._plan = plan
        self._stream = iter(stream)
        self._index = -1
        self._tensor: torch.Tensor | None = None

    def tensor(self, index: int) -> torch.Tensor:
        if index != self._index:
            assert index == self._index + 1, "plan pieces are in stream order"
            meta = self._plan.tensors[index]
            try:
                name, tensor = next(self._stream)
            except StopIteration:
                raise ValueError(
                    f"weight stream ended after {index} tensors but the metadata given to "
                    f"prepare() has {len(self._plan.tensors)} (next: {meta.name!r})"
                ) from None
            check_tensor(meta, name, tensor)
            self._index, self._tensor = index, tensor
        assert self._tensor is not None
        return self._tensor

    def finish(self) -> None:
        extra = next(self._stream, None)
        if extra is not None:
            raise ValueError(
                f"weight stream yielded {extra[0]!r} after the {len(self._plan.tensors)} tensors "
                "of the metadata given to prepare(); pass the same stream's metadata"
            )
        self._tensor = None


class RefitSender:
    """Trainer rank 0's end of a refit: ``spec = prepare(metadata)``, then ``send(stream)``."""

    transport: Transport

    def __init__(
        self,
        bucket_bytes: int,
        device: torch.device,
        num_receivers: int,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> None:
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers}; a refit needs >= 1 receiver")
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.num_receivers = num_receivers
        self.timeout_s = timeout_s
        self._host = host
        self._store = serve_store(host, timeout_s)
        self._refit_id = 0
        self._attach_seconds = 0.0
        """Of the current send(): time spent waiting for the receivers to join."""
        self._plan: BucketPlan | None = None
        self._spec: RefitSpec | None = None

    def prepare(
        self, metadata: Iterable[Any], live_tensors: Iterable[torch.Tensor] = ()
    ) -> RefitSpec:
        """Plan the buckets of the next refit and return the spec its receivers need.

        ``live_tensors``: the tensors ``send(..., live=True)`` will stream, when they exist now
        (a trainer's parameters). A transport may then let the receivers map their memory as
        they attach instead of on the first bucket that names it, and announce every bucket
        before ``send`` walks the stream, which it then checks (colocated on CUDA does both)."""
        if self._spec is not None:
            raise RuntimeError("prepare() called twice without send(); send the prepared refit")
        metas = tuple(as_metadata(metadata))
        if self._plan is None or self._plan.tensors != metas:  # else the last refit's plan
            self._plan = plan_buckets(metas, self.bucket_bytes)
        self._refit_id += 1
        self._spec = self._shared_ahead(self._make_spec(self._refit_id, self._plan), live_tensors)
        return self._spec

    def send(
        self, weight_stream: Iterable[tuple[str, torch.Tensor]], *, live: bool = False
    ) -> SendStats:
        """Pack and send the stream bucket by bucket; returns when every receiver has it.

        ``live``: the stream yields tensors that stay alive and unchanged until ``send()``
        returns (a trainer's own parameters, not gathers or casts). A transport may then let
        the receivers read them in place instead of packing them (colocated on CUDA does).
        """
        spec, self._spec = self._spec, None
        if spec is None:
            raise RuntimeError("send() without prepare(); call prepare(metadata) first")
        start = time.perf_counter()
        finished = start
        buckets = spec.plan.buckets
        in_place = 0
        try:
            self._begin(spec, live)
            self._attach_seconds = time.perf_counter() - start
            cursor = _StreamCursor(spec.plan, weight_stream)
            for i, bucket in enumerate(buckets):
                slot = i % NUM_SLOTS
                free = i < NUM_SLOTS  # else the slot is free once bucket i - 2 is consumed
                for piece in bucket.pieces:
                    tensor = cursor.tensor(piece.tensor_index)
                    if live and self._share(i, piece, tensor):
                        in_place += piece.num_bytes
                        continue
                    if not free:  # only before packing: a bucket read in place waits for nothing
                        self._wait_slot(spec, i - NUM_SLOTS)
                        free = True
                    pack_piece(self._buffer(slot), piece, tensor)
                if i == len(buckets) - 1:
                    cursor.finish()  # before the last publish: receivers must not finish first
                self._publish(spec, i, slot, bucket.used_bytes)
            if not buckets:
                cursor.finish()
            finished = time.perf_counter()
            for i in range(max(0, len(buckets) - NUM_SLOTS), len(buckets)):
                self._wait_slot(spec, i)
            self._end(spec)
        except BaseException as error:
            self._abort(spec, f"sender failed: {type(error).__name__}: {error}")
            raise
        finally:
            self._release(spec)
        end = time.perf_counter()
        return SendStats(
            end - start,
            spec.plan.total_bytes,
            len(buckets),
            self._attach_seconds,
            end - finished,
            in_place,
        )

    def close(self) -> None:
        """Free everything cached across refits (store, process group)."""

    # Transport hooks.
    def _make_spec(self, refit_id: int, plan: BucketPlan) -> RefitSpec:
        raise NotImplementedError

    def _shared_ahead(self, spec: RefitSpec, live_tensors: Iterable[torch.Tensor]) -> RefitSpec:
        """``spec`` with what the receivers may open before the first bucket (see prepare)."""
        return spec

    def _begin(self, spec: RefitSpec, live: bool) -> None:
        """Start the refit of ``spec`` (``live``: as given to ``send``)."""
        raise NotImplementedError

    def _buffer(self, slot: int) -> torch.Tensor:
        raise NotImplementedError

    def _share(self, index: int, piece: Piece, tensor: torch.Tensor) -> bool:
        """Let the receivers read ``piece`` of a live ``tensor`` in place (bucket ``index``);
        False: pack it."""
        return False

    def _publish(self, spec: RefitSpec, index: int, slot: int, num_bytes: int) -> None:
        raise NotImplementedError

    def _wait_slot(self, spec: RefitSpec, index: int) -> None:
        raise NotImplementedError

    def _end(self, spec: RefitSpec) -> None:
        raise NotImplementedError

    def _abort(self, spec: RefitSpec, message: str) -> None:
        raise NotImplementedError

    def _release(self, spec: RefitSpec) -> None:
        raise NotImplementedError


class RefitReceiver:
    """A generator worker's end of a refit.

    ``iter_weights()`` yields ``(name, tensor)`` in metadata order. A tensor that fits a bucket
    is a view into the receiver's (or the shared) bucket buffer: it is valid only until the
    iterator advances past its bucket, so consumers copy it (``param.copy_``, vLLM
    ``reload_weights``). Tensors split across buckets are yielded as owned tensors. In a live
    colocated refit on CUDA, tensors are views into the trainer's own memory, valid until the
    iterator ends. Colocated on CUDA, the iterator unmaps the trainer's memory when it ends:
    a view used after that reads unmapped memory. ``copy_into(targets)`` receives straight
    into the consumer's tensors instead (no views handed out).
    """

    def __init__(self, spec: RefitSpec, device: torch.device, rank: int) -> None:
        if not 1 <= rank <= spec.num_receivers:
            raise ValueError(
                f"receiver rank={rank} is outside 1..{spec.num_receivers} (rank 0 is the trainer)"
            )
        self.spec = spec
        self.device = device
        self.rank = rank

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
            for bucket, buffer in received:
                in_place = self._in_place()
                yield [
                    (plan.tensors[i].name, self._in_place_view(i) if tensor is None else tensor)
                    for i, tensor in unpack_bucket(buffer, bucket, plan, partial, in_place)
                ]

    def copy_into(self, targets: Sequence[torch.Tensor] | TargetRuns) -> int:
        """Receive the refit into ``targets``: ``targets[i]`` takes the stream's tensor ``i``
        (``spec.plan.tensors[i]``, whose shape and dtype it must have). The copies are batched
        per bucket (``copy_tensors``); what a colocated sender shares in place is copied in runs
        straight out of its memory (``TargetRuns``), with no tensor made per parameter. A
        ``TargetRuns`` kept across refits is checked against the plan only when its key changes.
        Returns the number of copies launched; they are enqueued on the current stream."""
        plan = self.spec.plan
        runs: list[TargetRuns] = []

        def check_targets() -> None:  # once attached: a wrong target fails the sender fast too
            found = targets if isinstance(targets, TargetRuns) else TargetRuns(targets)
            if found.checked != plan.key or not plan.key:
                if len(found.tensors) != len(plan.tensors):
                    raise ValueError(
                        f"copy_into: {len(found.tensors)} targets for a refit of "
                        f"{len(plan.tensors)} tensors"
                    )
                for meta, target in zip(plan.tensors, found.tensors, strict=True):
                    check_target(meta, target)
                found.checked = plan.key
            runs.append(found)

        copies = 0
        partial: dict[int, torch.Tensor] = {}
        with contextlib.closing(self._received(check_targets)) as received:
            for bucket, buffer in received:
                copies += self._copy_in_place(bucket, runs[0])
                in_place = self._in_place()
                if len(in_place) == len(bucket.pieces):
                    continue  # nothing packed
                pairs = [
                    (runs[0].tensors[i], tensor)
                    for i, tensor in unpack_bucket(buffer, bucket, plan, partial, in_place)
                    if tensor is not None
                ]
                if pairs:
                    copies += copy_tensors([dst for dst, _ in pairs], [src for _, src in pairs])
        return copies

    def _received(
        self, attached: Callable[[], None] = lambda: None
    ) -> Generator[tuple[Bucket, torch.Tensor], None, None]:
        """Each bucket with the buffer holding its packed pieces, until the consumer asks for
        the next one; the receiver's signals around them (ends them on an early stop or an
        error too, so the sender fails fast). ``attached`` runs once the receiver has attached,
        before it waits for the first bucket."""
        completed = False
        try:
            self._begin()
            attached()
            for i, bucket in enumerate(self.spec.plan.buckets):
                yield bucket, self._wait_bucket(i)
                self._done_bucket(i)
            self._confirm()
            completed = True
        finally:
            # Also on GeneratorExit: a consumer that stops early must not leave the sender hanging.
            self._end(completed)

    def _begin(self) -> None:
        raise NotImplementedError

    def _wait_bucket(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def _done_bucket(self, index: int) -> None:
        raise NotImplementedError

    def _confirm(self) -> None:
        """After the last bucket: wait until the sender has checked what it published ahead of
        walking its stream, if it did (colocated); RefitError if the check failed."""

    def _in_place(self) -> Collection[int]:
        """Indices of the current bucket's tensors that the sender shared in place."""
        return ()

    def _in_place_view(self, index: int) -> torch.Tensor:
        """Tensor ``index`` (one of ``_in_place()``) where the sender holds it."""
        raise NotImplementedError

    def _copy_in_place(self, bucket: Bucket, targets: TargetRuns) -> int:
        """Copy the tensors ``bucket`` completes that were shared in place into their targets;
        returns the number of copies."""
        return 0

    def _end(self, completed: bool) -> None:
        raise NotImplementedError


def metadata_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Metadata of a stream of named tensors (works on ``meta`` tensors too)."""
    return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in tensors]
