"""Colocated refit: trainer and generator share a host (CPU) or a device (GPU).

The two bucket buffers are shared, not copied: one file in /dev/shm mapped by both processes on
CPU, one CUDA allocation of the trainer opened by the generator through a CUDA IPC handle on
GPU. Per bucket, a standalone TCPStore carries ``ready`` (sender → receivers) and ``done``
(receivers → sender) signals; the sender packs slot ``i % 2`` again only after every receiver
is done with bucket ``i - 2``, and it packs the first two buckets while the receivers are still
attaching. The buffers live for one refit: they are freed (and the file unlinked) when
``send()`` returns or fails, so the trainer's memory returns to what it was.

On CUDA the signals say that the copies were *enqueued*, not finished: each side records an
interprocess CUDA event after its copies and the other side's stream waits for that event
before touching the slot. Neither process blocks its CPU on the GPU per bucket, so packing,
signalling and the receiver's copies overlap. An event waited on is always recorded first: the
store signal that names bucket ``i`` is set only after the record.

A live stream on CUDA (``send(stream, live=True)``: the trainer's own parameters) is mostly
not packed: the ``ready`` signal of a bucket names runs of its tensors that lie back to back
in the trainer's memory (first tensor, count, allocator segment, offset; a trainer after
``onload()`` has a run per bucket), and carries the IPC handle of a segment the first time it
is named. Receivers map each segment once per refit and copy the tensors straight out of the
trainer's memory: one copy per byte instead of two (``cuda_ipc``), and with ``copy_into`` one
launch per run where their own tensors lie back to back too. Still packed: a
tensor that is not contiguous, not on the device, or in memory CUDA IPC cannot share. On CUDA
the bucket memory is allocated (and announced in a ``ready`` signal, then mapped) only once a
bucket holds a packed tensor: a refit read wholly in place allocates nothing.

When ``prepare()`` is given the live tensors and every one of them can be read in place, it
works out every bucket's ``ready`` signal there. ``send(live=True)`` then records the events and
sets every ``ready`` at once, before it walks the stream, so the receivers start copying while
the trainer checks that the stream's tensors are the ones ``prepare()`` found (the same runs,
bucket by bucket). Those signals ask the receivers to wait for a ``confirmed`` signal, set after
the check, before they report the refit done; a failed check aborts it on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from tandem.tensors.copies import TargetRuns
from tandem.weight_sync.base import (
    NUM_SLOTS,
    RefitError,
    RefitReceiver,
    RefitSender,
    RefitSpec,
    abort_signal,
    connect_store,
    set_signals,
    slot_layout,
    wait_signals,
)
from tandem.weight_sync.buckets import Bucket, BucketPlan, Piece
from tandem.weight_sync.cuda_ipc import CudaIpcError, SegmentTable, close_segment, open_segment

logger = logging.getLogger(__name__)


def _key(refit_id: int, *parts: object) -> str:
    return "/".join(["colocated", str(refit_id), *map(str, parts)])


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _slots(whole: torch.Tensor, size: int, num_slots: int) -> list[torch.Tensor]:
    return [whole[i * size : (i + 1) * size] for i in range(num_slots)]


@functools.cache
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class ColocatedSender(RefitSender):
    """Shares two bucket buffers with the receivers of the same host/device."""

    transport = "colocated"

    def __init__(
        self,
        bucket_bytes: int,
        device: torch.device,
        num_receivers: int,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(bucket_bytes, device, num_receivers, timeout_s, host)
        self._buffers: list[torch.Tensor] = []
        self._paths: list[str] = []
        self._attached = False
        self._packed: list[Any] = []  # per slot: event recorded when the slot is packed (CUDA)
        self._consumed: list[list[Any]] = []  # per receiver, per slot: its copies' event (CUDA)
        self._segments = SegmentTable(device)  # where live tensors are (CUDA)
        self._shared: dict[str, Any] = {}  # of the bucket being packed: what _publish announces
        self._run: list[int] = []  # the open run of in-place tensors: first, count, segment, offset
        self._run_next = self._run_end = -1  # where its next tensor must start; its segment's end
        self._slot_layout = (0, 0)  # bytes of one slot, number of slots
        # Per bucket, from prepare(live_tensors): the runs its ready signal names, and the
        # signal itself; empty when some tensor would be packed. Sent ahead by a live send().
        self._ahead: list[tuple[dict[str, Any], str]] = []
        self._ahead_now = False  # this send() set every ready signal at its start

    def _make_spec(self, refit_id: int, plan: BucketPlan) -> RefitSpec:
        # Both slots in one allocation (one file, one IPC handle to open), each only as large as
        # the largest bucket: a tiny model does not pin 2 x bucket_bytes.
        size, num_slots = slot_layout(plan)
        self._slot_layout = (size, num_slots)
        handles: tuple[Any, ...] = ()
        if self.device.type == "cpu":
            path = os.path.join(_shm_dir(), f"tandem-refit-{os.getpid()}-{uuid.uuid4().hex}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            self._paths.append(path)
            os.ftruncate(fd, size * num_slots)
            os.close(fd)
            whole = torch.from_file(path, True, size * num_slots, dtype=torch.uint8)
            handles = (path,)
            # If send() never runs (or the process ends), the file still goes away.
            weakref.finalize(self, _unlink_all, list(self._paths))
            self._buffers = _slots(whole, size, num_slots)
        else:  # the slots are allocated by the first packed piece (_buffer)
            self._packed = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
            self._segments = SegmentTable(self.device)
        return RefitSpec(
            refit_id=refit_id,
            transport="colocated",
            device_type=self.device.type,
            plan=plan,
            store_host=self._host,
            store_port=self._store.port,
            num_receivers=self.num_receivers,
            timeout_s=self.timeout_s,
            buffers=handles,
            events=tuple(event.ipc_handle() for event in self._packed),
        )

    def _shared_ahead(self, spec: RefitSpec, live_tensors: Iterable[torch.Tensor]) -> RefitSpec:
        self._ahead = []
        if self.device.type != "cuda":
            return spec
        live = list(live_tensors)
        self._ahead = self._signals_ahead(spec.plan, live)  # finds their allocations, as send()
        if not self._ahead:  # some would be packed: find the allocations of the others
            self._locate_all(live)
        segments = tuple(
            (i, segment.handle.hex(), segment.size)
            for i, segment in enumerate(self._segments.by_id)
        )
        return dataclasses.replace(spec, segments=segments)

    def _locate_all(self, tensors: list[torch.Tensor]) -> None:
        device_index = self.device.index
        if device_index is None:
            device_index = torch.cuda.current_device()
        low = high = 0  # the last segment found: most tensors lie in the one before them
        for tensor in tensors:
            ptr = tensor.data_ptr()  # (device pointers and host pointers never overlap)
            if low <= ptr < high:
                continue
            if tensor.is_cuda and tensor.get_device() == device_index and tensor.nbytes:
                with contextlib.suppress(CudaIpcError):  # not shareable: packed in send()
                    segment = self._segments.by_id[self._segments.locate(ptr)[0]]
                    low, high = segment.base, segment.base + segment.size

    def _signals_ahead(
        self, plan: BucketPlan, live: list[torch.Tensor]
    ) -> list[tuple[dict[str, Any], str]]:
        """Every bucket's ``ready`` signal when ``live``, streamed in order, is read wholly in
        place (as ``send`` would work it out); [] when some piece would be packed."""
        if len(live) != len(plan.tensors):
            return []
        ahead = []
        try:
            for i, bucket in enumerate(plan.buckets):
                for piece in bucket.pieces:
                    if not self._share(i, piece, live[piece.tensor_index]):
                        return []
                self._shared.pop("segments", None)  # named in the spec, mapped as they attach
                signal = json.dumps({**self._shared, "confirm": 1})
                ahead.append((self._shared, signal))
                self._shared, self._run = {}, []
        finally:
            self._shared, self._run = {}, []
        return ahead

    def _ranks(self) -> range:
        return range(1, self.num_receivers + 1)

    def _begin(self, spec: RefitSpec, live: bool) -> None:
        self._attached = False  # the receivers attach while the first two buckets are packed
        self._ahead_now = live and bool(self._ahead)
        if self._ahead_now:  # every bucket is read where prepare() found it: announce them all
            stream = torch.cuda.current_stream(self.device)
            for event in self._packed:
                event.record(stream)
            keys = [_key(spec.refit_id, "ready", i) for i in range(len(self._ahead))]
            set_signals(self._store, keys, [signal for _, signal in self._ahead])

    def _attach(self, spec: RefitSpec) -> None:
        """Wait (once per refit) until every receiver has opened the buffers."""
        if self._attached:
            return
        start = time.perf_counter()
        keys = [_key(spec.refit_id, "attached", rank) for rank in self._ranks()]
        values = wait_signals(
            self._store, keys, spec.timeout_s, "the receivers to attach the buffers"
        )
        # Every receiver has mapped the file: unlink now, so nothing is left if anyone dies.
        _unlink_all(self._paths)
        if self.device.type == "cuda":  # each receiver's attach signal carries its event handles
            self._consumed = [
                [
                    torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(handle))
                    for handle in value.decode().split(",")
                ]
                for value in values
            ]
        self._attached = True
        self._attach_seconds += time.perf_counter() - start

    def _buffer(self, slot: int) -> torch.Tensor:
        if not self._buffers:  # CUDA, first packed piece of this refit
            size, num_slots = self._slot_layout
            whole = torch.empty(size * num_slots, dtype=torch.uint8, device=self.device)
            try:
                segment, offset = self._announce(whole.data_ptr())
            except CudaIpcError as error:
                raise CudaIpcError(
                    f"colocated refit cannot share its bucket memory with the generators: "
                    f"{error}. CUDA IPC shares cudaMalloc'd memory only; unset "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the trainer's environment"
                ) from error
            self._shared["buffers"] = [segment, offset]
            self._buffers = _slots(whole, size, num_slots)
        return self._buffers[slot]

    def _announce(self, ptr: int) -> tuple[int, int]:
        """(segment id, offset) of device memory at ``ptr``; the segment's IPC handle goes into
        the next ``ready`` signal the first time it is named."""
        segment, offset, new = self._segments.locate(ptr)
        if new:
            found = self._segments.by_id[segment]
            self._shared.setdefault("segments", {})[segment] = [found.handle.hex(), found.size]
        return segment, offset

    def _share(self, index: int, piece: Piece, tensor: torch.Tensor) -> bool:
        if self.device.type != "cuda":
            return False
        ptr = tensor.data_ptr()
        run = self._run
        # The hot path: the next tensor of the stream starts where the open run ends. (A
        # pointer inside one of this device's segments is memory of this device.)
        if (
            run
            and ptr == self._run_next
            and piece.tensor_index == run[0] + run[1]
            and ptr + piece.tensor_bytes <= self._run_end
            and tensor.is_contiguous()
        ):
            run[1] += 1
            self._run_next = ptr + piece.tensor_bytes
            return True
        if not tensor.is_cuda or not tensor.is_contiguous():
            return False
        device_index = self.device.index
        if device_index is None:
            device_index = torch.cuda.current_device()
        if tensor.get_device() != device_index:
            return False
        # A segment may also hold the buckets: opening it twice is fine (the driver counts).
        try:
            segment, offset = self._announce(ptr)
        except CudaIpcError:  # not cudaMalloc'd memory (another allocator): pack it
            return False
        self._run = [piece.tensor_index, 1, segment, offset]
        self._shared.setdefault("runs", []).append(self._run)
        self._run_next = ptr + piece.tensor_bytes
        self._run_end = ptr - offset + self._segments.by_id[segment].size
        return True

    def _publish(self, spec: RefitSpec, index: int, slot: int, num_bytes: int) -> None:
        if self._ahead_now:  # announced in _begin: check what the stream brought instead
            shared, self._shared, self._run = self._shared, {}, []
            expected = self._ahead[index][0]
            if shared != expected:
                raise ValueError(
                    f"bucket {index} of the live stream is not where prepare() found it (runs "
                    f"{shared.get('runs')}, expected {expected.get('runs')}): stream the "
                    "tensors given to prepare(live_tensors=...), unmoved"
                )
            if index == len(spec.plan.buckets) - 1:
                self._store.set(_key(spec.refit_id, "confirmed"), "1")
            return
        if self.device.type == "cuda":
            # also orders the receivers' reads of live tensors after the trainer's last writes
            self._packed[slot].record(torch.cuda.current_stream(self.device))
        value = json.dumps(self._shared) if self._shared else "1"
        self._shared, self._run = {}, []
        self._store.set(_key(spec.refit_id, "ready", index), value)

    def _wait_slot(self, spec: RefitSpec, index: int) -> None:
        self._attach(spec)
        keys = [_key(spec.refit_id, "done", index, rank) for rank in self._ranks()]
        wait_signals(self._store, keys, spec.timeout_s, f"the receivers to finish bucket {index}")
        if self.device.type == "cuda":  # the slot is packed again only after their copies
            stream = torch.cuda.current_stream(self.device)
            for events in self._consumed:
                stream.wait_event(events[index % NUM_SLOTS])

    def _end(self, spec: RefitSpec) -> None:
        self._attach(spec)
        # Every receiver is done with the last bucket, so every signal but "confirmed" (read
        # after the last bucket) and "released" has been read: delete them while the receivers
        # wait for their last copies and unmap.
        num_buckets = len(spec.plan.buckets)
        for index in range(num_buckets):
            self._store.delete_key(_key(spec.refit_id, "ready", index))
        for rank in self._ranks():
            self._store.delete_key(_key(spec.refit_id, "attached", rank))
            for index in range(num_buckets):
                self._store.delete_key(_key(spec.refit_id, "done", index, rank))
        keys = [_key(spec.refit_id, "released", rank) for rank in self._ranks()]
        wait_signals(self._store, keys, spec.timeout_s, "the receivers to release the buffers")
        if self._ahead_now:
            keys.append(_key(spec.refit_id, "confirmed"))
        for key in keys:
            self._store.delete_key(key)

    def _abort(self, spec: RefitSpec, message: str) -> None:
        keys = [_key(spec.refit_id, "ready", i) for i in range(len(spec.plan.buckets))]
        if self._ahead_now:  # the receivers have every ready signal: they wait for this one
            keys.append(_key(spec.refit_id, "confirmed"))
        if keys:
            set_signals(self._store, keys, abort_signal(message))

    def _release(self, spec: RefitSpec) -> None:
        allocated = bool(self._buffers)
        self._buffers = []
        self._packed, self._consumed = [], []
        self._segments, self._shared, self._run = SegmentTable(self.device), {}, []
        self._ahead, self._ahead_now = [], False
        _unlink_all(self._paths)
        self._paths.clear()
        if self.device.type == "cuda" and allocated:  # hand the slots' memory back
            torch.cuda.empty_cache()


class ColocatedReceiver(RefitReceiver):
    """Reads the trainer's shared buffers; see ``RefitReceiver`` for the view lifetime."""

    def _begin(self) -> None:
        spec = self.spec
        if self.device.type != spec.device_type:
            raise ValueError(
                f"colocated refit: the trainer's buffers are on {spec.device_type} but this "
                f"receiver is on {self.device}; use the trainer's device type or transport=split"
            )
        self._store: dist.TCPStore = connect_store(spec.store_host, spec.store_port, spec.timeout_s)
        self._buffers: list[torch.Tensor] = []
        self._slots_at: tuple[int, int] | None = None  # segment and offset of the slots (CUDA)
        self._known: dict[int, tuple[str, int]] = {}  # the trainer's segments: handle, size
        self._mapped: dict[int, tuple[int, torch.Tensor]] = {}  # those opened: pointer, bytes
        self._runs: list[list[int]] = []  # of the current bucket: first, count, segment, offset
        self._shared_here: set[int] = set()  # the tensors of those runs
        self._nothing = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._located: dict[int, tuple[int, int]] = {}  # where they are: segment, offset
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # segments as a dtype
        self._confirming = False  # a ready signal was sent ahead: wait for "confirmed"
        if spec.device_type == "cpu":
            (path,) = spec.buffers
            self._map_buffers(path)  # from_file: cheap, and the sender unlinks it once attached
            attached = "1"
        else:  # the slots are announced and mapped when a bucket is packed
            for segment, handle, size in spec.segments:  # the sender's live tensors: map now
                self._known[segment] = (handle, size)
                self._segment(segment)
            self._packed = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in spec.events]
            self._consumed = [torch.cuda.Event(interprocess=True) for _ in spec.events]
            attached = ",".join(event.ipc_handle().hex() for event in self._consumed)
        self._store.set(_key(spec.refit_id, "attached", self.rank), attached)

    def _map_buffers(self, path: str | None = None) -> None:
        size, num_slots = slot_layout(self.spec.plan)
        if path is not None:
            if not os.path.exists(path):  # (from_file would create it, and leave it behind)
                raise RefitError(
                    f"refit {self.spec.refit_id}: the trainer's buffers {path} are gone: the "
                    "refit already ended (a stale spec) or the trainer died"
                )
            whole = torch.from_file(path, True, size * num_slots, dtype=torch.uint8)
        else:
            assert self._slots_at is not None, "a packed bucket's ready signal names the slots"
            segment, offset = self._slots_at
            whole = self._segment(segment)[offset : offset + size * num_slots]
        self._buffers = _slots(whole, size, num_slots)

    def _segment(self, segment: int) -> torch.Tensor:
        """The bytes of one of the trainer's segments, mapped on first use."""
        if segment not in self._mapped:
            handle, size = self._known[segment]
            self._mapped[segment] = open_segment(bytes.fromhex(handle), size, self.device)
        return self._mapped[segment][1]

    def _wait_bucket(self, index: int) -> torch.Tensor:
        key = _key(self.spec.refit_id, "ready", index)
        what = f"the trainer to pack bucket {index}"
        (value,) = wait_signals(self._store, [key], self.spec.timeout_s, what)
        if self.device.type == "cuda":  # consumers copy on the current stream, after the packing
            torch.cuda.current_stream(self.device).wait_event(self._packed[index % NUM_SLOTS])
        shared = {} if value == b"1" else json.loads(value)
        self._confirming = self._confirming or "confirm" in shared
        for segment, (handle, size) in shared.get("segments", {}).items():
            self._known[int(segment)] = (handle, size)
        if "buffers" in shared:
            self._slots_at = tuple(shared["buffers"])  # type: ignore[assignment]
        self._runs, self._located = shared.get("runs", []), {}
        self._shared_here = set().union(*(range(run[0], run[0] + run[1]) for run in self._runs))
        if len(self._shared_here) == len(self.spec.plan.buckets[index].pieces):
            return self._nothing  # nothing packed
        if not self._buffers:
            self._map_buffers()
        return self._buffers[index % NUM_SLOTS]

    def _in_place(self) -> set[int]:
        return self._shared_here

    def _in_place_view(self, index: int) -> torch.Tensor:
        if not self._located:  # where every tensor of the bucket's runs is
            sizes = self.spec.plan.sizes
            for first, count, segment, offset in self._runs:
                for i in range(first, first + count):
                    self._located[i] = (segment, offset)
                    offset += sizes[i]
        meta = self.spec.plan.tensors[index]
        segment, offset = self._located[index]
        typed = self._typed.get((segment, meta.dtype))
        if typed is None:  # one view per segment and dtype; a tensor is then one as_strided
            raw = self._segment(segment)
            typed = raw[: raw.numel() - raw.numel() % meta.dtype.itemsize].view(meta.dtype)
            self._typed[(segment, meta.dtype)] = typed
        strides = _contiguous_strides(meta.shape)
        return typed.as_strided(meta.shape, strides, offset // meta.dtype.itemsize)

    def _copy_in_place(self, bucket: Bucket, targets: TargetRuns) -> int:
        copies, last = 0, bucket.pieces[-1]
        for first, count, segment, offset in self._runs:
            end = first + count
            if end - 1 == last.tensor_index and not last.is_last:
                end -= 1  # a split tensor whose last piece is still to come: copied then
            num_bytes = targets.starts[end] - targets.starts[first]  # the plan's sizes (checked)
            copies += targets.copy(first, end, self._segment(segment)[offset : offset + num_bytes])
        return copies

    def _done_bucket(self, index: int) -> None:
        if self.device.type == "cuda":  # the consumers' copies of this slot are enqueued
            self._consumed[index % NUM_SLOTS].record(torch.cuda.current_stream(self.device))
        self._store.set(_key(self.spec.refit_id, "done", index, self.rank), "1")

    def _confirm(self) -> None:
        if self._confirming:
            key = _key(self.spec.refit_id, "confirmed")
            what = "the trainer to check the weight stream it announced ahead"
            wait_signals(self._store, [key], self.spec.timeout_s, what)

    def _end(self, completed: bool) -> None:
        self._buffers, self._packed, self._consumed = [], [], []
        if self.device.type == "cuda":  # every copy out of the trainer's buffers has finished
            torch.cuda.synchronize(self.device)
        self._runs, self._shared_here, self._located, self._typed = [], set(), {}, {}
        for ptr, _ in getattr(self, "_mapped", {}).values():
            try:  # before "released": the trainer may free the memory after it
                close_segment(ptr, self.device)
            except CudaIpcError as error:
                logger.warning("refit %d: %s", self.spec.refit_id, error)
        self._mapped = {}
        if not hasattr(self, "_store"):
            return
        spec = self.spec
        value = "1"
        if not completed:
            value = abort_signal(f"receiver rank {self.rank} stopped before the end of the refit")
            num_buckets = len(spec.plan.buckets)
            keys = [_key(spec.refit_id, "done", i, self.rank) for i in range(num_buckets)]
            keys.append(_key(spec.refit_id, "attached", self.rank))
        else:
            keys = []
        keys.append(_key(spec.refit_id, "released", self.rank))
        try:
            set_signals(self._store, keys, value)
        except dist.DistError as error:  # the trainer is gone: nothing left to tell it
            logger.warning("refit %d: could not signal the trainer: %s", spec.refit_id, error)
