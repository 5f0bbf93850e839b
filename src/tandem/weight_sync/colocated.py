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
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from tandem.weight_sync.base import (
    NUM_SLOTS,
    RefitReceiver,
    RefitSender,
    RefitSpec,
    abort_signal,
    connect_store,
    set_signals,
    slot_layout,
    wait_signals,
)
from tandem.weight_sync.buckets import BucketPlan

logger = logging.getLogger(__name__)

_DEVICE_ARG = 6
"""Position of ``storage_device`` in the arguments of torch's ``rebuild_cuda_tensor``."""


def _key(refit_id: int, *parts: object) -> str:
    return "/".join(["colocated", str(refit_id), *map(str, parts)])


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _slots(whole: torch.Tensor, size: int, num_slots: int) -> list[torch.Tensor]:
    return [whole[i * size : (i + 1) * size] for i in range(num_slots)]


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

    def _make_spec(self, refit_id: int, plan: BucketPlan) -> RefitSpec:
        # Both slots in one allocation (one file, one IPC handle to open), each only as large as
        # the largest bucket: a tiny model does not pin 2 x bucket_bytes.
        size, num_slots = slot_layout(plan)
        handles: tuple[Any, ...]
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
        else:
            whole = torch.empty(size * num_slots, dtype=torch.uint8, device=self.device)
            # One handle per receiver: each consumer holds its own IPC reference.
            handles = tuple(reduce_tensor(whole) for _ in range(self.num_receivers))
            self._packed = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
        self._buffers = _slots(whole, size, num_slots)
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

    def _ranks(self) -> range:
        return range(1, self.num_receivers + 1)

    def _begin(self, spec: RefitSpec) -> None:
        self._attached = False  # the receivers attach while the first two buckets are packed

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
        return self._buffers[slot]

    def _publish(self, spec: RefitSpec, index: int, slot: int, num_bytes: int) -> None:
        if self.device.type == "cuda":
            self._packed[slot].record(torch.cuda.current_stream(self.device))
        self._store.set(_key(spec.refit_id, "ready", index), "1")

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
        keys = [_key(spec.refit_id, "released", rank) for rank in self._ranks()]
        wait_signals(self._store, keys, spec.timeout_s, "the receivers to release the buffers")
        num_buckets = len(spec.plan.buckets)
        for index in range(num_buckets):
            self._store.delete_key(_key(spec.refit_id, "ready", index))
        for rank in self._ranks():
            self._store.delete_key(_key(spec.refit_id, "attached", rank))
            self._store.delete_key(_key(spec.refit_id, "released", rank))
            for index in range(num_buckets):
                self._store.delete_key(_key(spec.refit_id, "done", index, rank))

    def _abort(self, spec: RefitSpec, message: str) -> None:
        keys = [_key(spec.refit_id, "ready", i) for i in range(len(spec.plan.buckets))]
        if keys:
            set_signals(self._store, keys, abort_signal(message))

    def _release(self, spec: RefitSpec) -> None:
        self._buffers.clear()
        self._packed, self._consumed = [], []
        _unlink_all(self._paths)
        self._paths.clear()
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # frees blocks the receivers no longer reference
            torch.cuda.empty_cache()


def _open_ipc(handle: Any, device: torch.device) -> torch.Tensor:
    rebuild, args = handle
    args = list(args)
    # The trainer's device index means nothing here (CUDA_VISIBLE_DEVICES differs per actor).
    args[_DEVICE_ARG] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild(*args)


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
        size, num_slots = slot_layout(spec.plan)
        if spec.device_type == "cpu":
            (path,) = spec.buffers
            whole = torch.from_file(path, True, size * num_slots, dtype=torch.uint8)
            attached = "1"
        else:
            whole = _open_ipc(spec.buffers[self.rank - 1], self.device)
            self._packed = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in spec.events]
            self._consumed = [torch.cuda.Event(interprocess=True) for _ in spec.events]
            attached = ",".join(event.ipc_handle().hex() for event in self._consumed)
        self._buffers = _slots(whole, size, num_slots)
        self._store.set(_key(spec.refit_id, "attached", self.rank), attached)

    def _wait_bucket(self, index: int) -> torch.Tensor:
        key = _key(self.spec.refit_id, "ready", index)
        wait_signals(self._store, [key], self.spec.timeout_s, f"the trainer to pack bucket {index}")
        if self.device.type == "cuda":  # consumers copy on the current stream, after the packing
            torch.cuda.current_stream(self.device).wait_event(self._packed[index % NUM_SLOTS])
        return self._buffers[index % NUM_SLOTS]

    def _done_bucket(self, index: int) -> None:
        if self.device.type == "cuda":  # the consumers' copies of this slot are enqueued
            self._consumed[index % NUM_SLOTS].record(torch.cuda.current_stream(self.device))
        self._store.set(_key(self.spec.refit_id, "done", index, self.rank), "1")

    def _end(self, completed: bool) -> None:
        self._buffers, self._packed, self._consumed = [], [], []
        if self.device.type == "cuda":  # every copy out of the trainer's buffers has finished
            torch.cuda.synchronize(self.device)
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
