"""Colocated refit: trainer and generator share a host (CPU) or a device (GPU).

The two bucket buffers are shared, not copied: files in /dev/shm mapped by both processes on CPU,
CUDA buffers of the trainer opened by the generator through CUDA IPC handles on GPU. Per bucket,
a standalone TCPStore carries ``ready`` (sender → receivers) and ``done`` (receivers → sender)
signals; the sender packs slot ``i % 2`` again only after every receiver is done with bucket
``i - 2``. The buffers live for one refit: they are freed (and the files unlinked) when
``send()`` returns or fails, so the trainer's memory returns to what it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
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

    def _make_spec(self, refit_id: int, plan: BucketPlan) -> RefitSpec:
        # Only as large as the largest bucket: a tiny model does not pin 2 x bucket_bytes.
        size = max((bucket.used_bytes for bucket in plan.buckets), default=0)
        num_slots = min(NUM_SLOTS, len(plan.buckets))
        handles: list[Any] = []
        if self.device.type == "cpu":
            for _ in range(num_slots):
                path = os.path.join(_shm_dir(), f"tandem-refit-{os.getpid()}-{uuid.uuid4().hex}")
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                self._paths.append(path)
                os.ftruncate(fd, size)
                os.close(fd)
                self._buffers.append(torch.from_file(path, True, size, dtype=torch.uint8))
                handles.append((path, size))
            # If send() never runs (or the process ends), the files still go away.
            weakref.finalize(self, _unlink_all, list(self._paths))
        else:
            for _ in range(num_slots):
                buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._buffers.append(buffer)
                # One handle per receiver: each consumer holds its own IPC reference.
                handles.append(tuple(reduce_tensor(buffer) for _ in range(self.num_receivers)))
        return RefitSpec(
            refit_id=refit_id,
            transport="colocated",
            device_type=self.device.type,
            plan=plan,
            store_host=self._host,
            store_port=self._store.port,
            num_receivers=self.num_receivers,
            timeout_s=self.timeout_s,
            buffers=tuple(handles),
        )

    def _ranks(self) -> range:
        return range(1, self.num_receivers + 1)

    def _begin(self, spec: RefitSpec) -> None:
        keys = [_key(spec.refit_id, "attached", rank) for rank in self._ranks()]
        wait_signals(self._store, keys, spec.timeout_s, "the receivers to attach the buffers")
        # Every receiver has mapped the files: unlink now, so nothing is left if anyone dies.
        _unlink_all(self._paths)

    def _buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def _publish(self, spec: RefitSpec, index: int, slot: int, num_bytes: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # packed bytes are in memory
        self._store.set(_key(spec.refit_id, "ready", index), "1")

    def _wait_slot(self, spec: RefitSpec, index: int) -> None:
        keys = [_key(spec.refit_id, "done", index, rank) for rank in self._ranks()]
        wait_signals(self._store, keys, spec.timeout_s, f"the receivers to finish bucket {index}")

    def _end(self, spec: RefitSpec) -> None:
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
        if spec.device_type == "cpu":
            self._buffers = [
                torch.from_file(path, True, size, dtype=torch.uint8) for path, size in spec.buffers
            ]
        else:
            self._buffers = [_open_ipc(h[self.rank - 1], self.device) for h in spec.buffers]
        self._store.set(_key(spec.refit_id, "attached", self.rank), "1")

    def _wait_bucket(self, index: int) -> torch.Tensor:
        key = _key(self.spec.refit_id, "ready", index)
        wait_signals(self._store, [key], self.spec.timeout_s, f"the trainer to pack bucket {index}")
        return self._buffers[index % NUM_SLOTS]

    def _done_bucket(self, index: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # consumers' copies have read it
        self._store.set(_key(self.spec.refit_id, "done", index, self.rank), "1")

    def _end(self, completed: bool) -> None:
        self._buffers = []
        if self.device.type == "cuda":
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
