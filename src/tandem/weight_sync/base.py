"""What every refit transport shares: the spec, the stats, and the send and receive loops.

A refit is planned once, in ``prepare()``: the buckets (``buckets.plan_buckets``, reused while
the metadata stays the same) and, for live tensors, what the receivers read in place
(``live.plan_runs``). ``send()`` walks that plan: it packs the other pieces into two slots that
alternate and announces the buckets batch by batch (``live.ready_batches``). A transport says
how one refit's buckets travel: ``RefitSender._open`` returns a ``SenderRefit`` (made by
``prepare()``, dropped when ``send()`` returns), and a ``RefitReceiver`` says how it gets bucket
``i`` and where the sender's memory is mapped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tandem.weight_sync.buckets import (
    BucketPacker,
    BucketPlan,
    TensorMeta,
    as_metadata,
    check_tensor,
    plan_buckets,
)
from tandem.weight_sync.live import (
    BucketRuns,
    in_place_bytes,
    packed_pieces,
    ready_batches,
)
from tandem.weight_sync.signals import serve_store

NUM_SLOTS = 2
"""Buffers that alternate: bucket i+1 is packed while bucket i is in flight."""

Transport = Literal["colocated", "split"]


@dataclass(frozen=True)
class RefitSpec:
    """Everything a receiver needs for one refit; picklable (crosses Ray and collective_rpc)."""

    refit_id: int
    transport: Transport
    device_type: str
    """Device type of the sender's memory ("cpu" or "cuda")."""
    plan: BucketPlan
    store_host: str
    store_port: int
    num_receivers: int
    timeout_s: float
    runs: tuple[BucketRuns, ...] = ()
    """Per bucket, the tensors the receivers read where the sender holds them (``live``);
    empty when the refit reads nothing in place."""
    shm_path: str = ""
    """colocated on the CPU: the shared-memory file that holds both slots."""
    events: tuple[bytes, ...] = ()
    """colocated on CUDA: per slot, the IPC handle of the event recorded when it is packed."""
    segments: tuple[tuple[bytes, int], ...] = ()
    """colocated on CUDA: the sender's allocations the receivers map as they attach (IPC
    handle, bytes), by segment id: those of the live tensors, and of the slots."""
    slots: tuple[int, int] | None = None
    """colocated on CUDA: segment and offset of the slots; None when nothing is packed."""
    group_generation: int = 0
    """split: which process group to join (a new one after a failed refit)."""
    store_id: str = ""
    """Which server listens at ``store_host:store_port`` (one per sender): a receiver's cached
    client or group of a gone sender on the same port is not reused."""

    def bucket_runs(self, index: int) -> BucketRuns:
        return self.runs[index] if self.runs else ()


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


class _LiveTensors:
    """The live tensors given to ``prepare()``, checked to be where they were then."""

    def __init__(self, plan: BucketPlan, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(plan.tensors):
            raise ValueError(
                f"prepare() got {len(tensors)} live_tensors for metadata of "
                f"{len(plan.tensors)} tensors; pass one tensor per metadata entry, in order"
            )
        pairs = zip(plan.tensors, tensors, strict=True)
        for meta, tensor in [(m, t) for m, t in pairs if t.shape != m.shape or t.dtype != m.dtype]:
            check_tensor(meta, meta.name, tensor)  # raises, naming it
        self._plan = plan
        self.tensors = tensors
        self._pointers = [t.data_ptr() for t in tensors]

    def check_unmoved(self) -> None:
        moved = [
            self._plan.tensors[i].name
            for i, (tensor, ptr) in enumerate(zip(self.tensors, self._pointers, strict=True))
            if tensor.data_ptr() != ptr
        ]
        if moved:
            raise ValueError(
                f"live tensors {moved[:3]} are not where prepare() found them (the sender's "
                "memory moved, e.g. an offload or onload, between prepare() and send()); "
                "call prepare() again after moving them"
            )

    def tensor(self, index: int) -> torch.Tensor:
        return self.tensors[index]

    def finish(self) -> None:
        pass


class SenderRefit:
    """One refit on the sender's side: made by ``prepare()`` (the transport's ``_open``) with
    the spec its receivers get, dropped when ``send()`` returns or fails."""

    def __init__(self, spec: RefitSpec) -> None:
        self.spec = spec
        self.packed = packed_pieces(spec.plan, spec.runs)
        """Per bucket, the pieces ``send()`` packs (the others are read in place)."""
        self.attach_seconds = 0.0
        """Time spent waiting for the receivers to join."""

    def begin(self) -> None:
        """``send()`` starts (split forms its group here)."""

    def buffer(self, slot: int) -> torch.Tensor:
        """The uint8 memory of ``slot``."""
        raise NotImplementedError

    def publish(self, indices: range) -> None:
        """Buckets ``indices`` are packed (or read in place): hand them to the receivers."""
        raise NotImplementedError

    def wait_slot(self, index: int) -> None:
        """Return once every receiver is done with bucket ``index``."""
        raise NotImplementedError

    def end(self) -> None:
        """After the last bucket: until the receivers no longer need anything of the sender."""

    def abort(self, message: str) -> None:
        """The refit failed here: end it on the receivers' side, fast."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the refit holds (always, last)."""


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
        self._store_id = uuid.uuid4().hex
        self._refit_id = 0
        self._plan: BucketPlan | None = None
        self._prepared: tuple[SenderRefit, _LiveTensors | None] | None = None

    def prepare(
        self, metadata: Iterable[Any], live_tensors: Iterable[torch.Tensor] = ()
    ) -> RefitSpec:
        """Plan the next refit and return the spec its receivers need.

        ``live_tensors``: the tensors to send, one per metadata entry, when they exist now and
        stay where they are until ``send()`` returns (a trainer's own parameters); ``send()``
        then takes no stream. A transport may let the receivers read them in place (colocated
        on CUDA does, mapping their memory as they attach). ``send()`` checks that they have
        not moved (an offload or onload in between fails it, on both sides)."""
        if self._prepared is not None:
            raise RuntimeError("prepare() called twice without send(); send the prepared refit")
        metas = tuple(as_metadata(metadata))
        if self._plan is None or self._plan.tensors != metas:  # else the last refit's plan
            self._plan = plan_buckets(metas, self.bucket_bytes)
        live_list = list(live_tensors)
        live = _LiveTensors(self._plan, live_list) if live_list else None
        self._refit_id += 1
        spec = RefitSpec(
            refit_id=self._refit_id,
            transport=self.transport,
            device_type=self.device.type,
            plan=self._plan,
            store_host=self._host,
            store_port=self._store.port,
            store_id=self._store_id,
            num_receivers=self.num_receivers,
            timeout_s=self.timeout_s,
        )
        refit = self._open(spec, live_list)
        self._prepared = (refit, live)
        return refit.spec

    def send(self, weight_stream: Iterable[tuple[str, torch.Tensor]] | None = None) -> SendStats:
        """Send the prepared refit; returns when every receiver has it. ``weight_stream``
        yields the tensors of the metadata, in order (not given when ``prepare()`` got the
        live tensors: they are sent)."""
        if self._prepared is None:
            raise RuntimeError("send() without prepare(); call prepare(metadata) first")
        (refit, live), self._prepared = self._prepared, None
        start = time.perf_counter()
        try:
            source = _source(refit.spec.plan, weight_stream, live)
            begun = time.perf_counter()
            refit.begin()
            attach = time.perf_counter() - begun
            _send_buckets(refit, source)
            finished = time.perf_counter()
            num_buckets = len(refit.spec.plan.buckets)
            for i in range(max(0, num_buckets - NUM_SLOTS), num_buckets):
                refit.wait_slot(i)
            refit.end()
        except BaseException as error:
            refit.abort(f"sender failed: {type(error).__name__}: {error}")
            raise
        finally:
            refit.close()
        end = time.perf_counter()
        spec = refit.spec
        return SendStats(
            end - start,
            spec.plan.total_bytes,
            len(spec.plan.buckets),
            attach + refit.attach_seconds,
            end - finished,
            in_place_bytes(spec.plan, spec.runs),
        )

    def close(self) -> None:
        """Free everything cached across refits (store, process group)."""

    def _open(self, spec: RefitSpec, live: list[torch.Tensor]) -> SenderRefit:
        """The transport's refit of ``spec`` (to which it adds what its receivers need);
        ``live``: the live tensors given to ``prepare()``, or []."""
        raise NotImplementedError


def _source(
    plan: BucketPlan,
    stream: Iterable[tuple[str, torch.Tensor]] | None,
    live: _LiveTensors | None,
) -> _StreamCursor | _LiveTensors:
    if live is None:
        if stream is None:
            raise ValueError("send() needs the weight stream: prepare() got no live_tensors")
        return _StreamCursor(plan, stream)
    if stream is not None:
        raise ValueError("prepare() got live_tensors, which send() sends: call send() alone")
    live.check_unmoved()
    return live


def _send_buckets(refit: SenderRefit, source: _StreamCursor | _LiveTensors) -> None:
    """Pack what is not read in place, bucket by bucket into the slot ``i % NUM_SLOTS`` once
    bucket ``i - NUM_SLOTS`` is consumed, and publish the buckets batch by batch."""
    batches = ready_batches(refit.packed)
    num_buckets = len(refit.spec.plan.buckets)
    for batch in batches:
        first = batch.start  # only a batch's first bucket packs anything
        pieces = refit.packed[first]
        if pieces:  # (a transport reading every tensor in place has no buffers to pack into)
            packer = BucketPacker(refit.buffer(first % NUM_SLOTS))  # runs of pieces in one copy
            for n, piece in enumerate(pieces):
                tensor = source.tensor(piece.tensor_index)  # (a gather overlaps the slot's wait)
                if n == 0 and first >= NUM_SLOTS:
                    refit.wait_slot(first - NUM_SLOTS)
                packer.add(piece, tensor)
            packer.flush()
        if batch.stop == num_buckets:
            source.finish()  # before the last publish: the receivers must not finish first
        refit.publish(batch)
    if not batches:
        source.finish()


def metadata_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Metadata of a stream of named tensors (works on ``meta`` tensors too)."""
    return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in tensors]
