"""Colocated refit: trainer and generators share a host (``shm``: CPU) or a device (``cuda``).

The two bucket slots are shared, not copied: the receivers map the sender's memory (a file in
/dev/shm, or CUDA allocations through IPC handles), and the slots live for one refit: they are
freed when ``send()`` returns or fails, so the trainer's memory returns to what it was. What
both share is the protocol of signals in the sender's store, here. Keys of refit ``r``:

- ``colocated/r/attached/<rank>``: the receiver has mapped the refit's memory (its value is
  what the sender needs of it: on CUDA its events' IPC handles);
- ``colocated/r/ready/<i>``: bucket ``i`` is packed. A batch of buckets is set at once
  (``live.ready_batches``) and a receiver reads a batch with one round trip;
- ``colocated/r/done/<i>/<rank>``: the receiver is done with bucket ``i``: its slot may be
  packed again;
- ``colocated/r/released/<rank>``: the receiver has unmapped everything; the sender may free it.

An abort overwrites every key the other side may wait on with ``abort:<message>``. The sender
deletes the keys after the receivers release: a refit leaves nothing in the store.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from tandem.weight_sync.base import RefitSpec, SenderRefit
from tandem.weight_sync.live import ready_batches
from tandem.weight_sync.receiver import RefitReceiver
from tandem.weight_sync.signals import (
    ABORT,
    abort_signal,
    connect_store,
    set_signals,
    wait_signals,
)

logger = logging.getLogger(__name__)


def key(refit_id: int, *parts: object) -> str:
    return "/".join(["colocated", str(refit_id), *map(str, parts)])


def slots_of(whole: torch.Tensor, size: int, num_slots: int) -> list[torch.Tensor]:
    """``num_slots`` slots of ``size`` bytes, back to back in ``whole``."""
    return [whole[i * size : (i + 1) * size] for i in range(num_slots)]


class ColocatedRefit(SenderRefit):
    """The sender's signals of one colocated refit. The receivers attach while the first two
    buckets are packed: the sender waits for them only before it needs them (a slot's reuse,
    or the end)."""

    def __init__(self, spec: RefitSpec, store: dist.TCPStore) -> None:
        super().__init__(spec)
        self._store = store
        self._attached = False

    def _keys(self, *parts: object) -> list[str]:
        """The key ``parts`` of every receiver (``rank`` fills in)."""
        return [
            key(self.spec.refit_id, *parts, rank) for rank in range(1, self.spec.num_receivers + 1)
        ]

    def _attach(self) -> None:
        if self._attached:
            return
        start = time.perf_counter()
        what = "the receivers to attach the buffers"
        values = wait_signals(self._store, self._keys("attached"), self.spec.timeout_s, what)
        self._on_attached(values)
        self._attached = True
        self.attach_seconds += time.perf_counter() - start

    def _on_attached(self, values: list[bytes]) -> None:
        """Every receiver has attached; ``values``: their attach signals, by rank."""

    def publish(self, indices: range) -> None:
        set_signals(self._store, [key(self.spec.refit_id, "ready", i) for i in indices], "1")

    def wait_slot(self, index: int) -> None:
        self._attach()
        what = f"the receivers to finish bucket {index}"
        wait_signals(self._store, self._keys("done", index), self.spec.timeout_s, what)

    def end(self) -> None:
        self._attach()
        # Every receiver is done with the last bucket, so it has read every signal but
        # "released": delete them while the receivers finish their copies and unmap.
        num_buckets = len(self.spec.plan.buckets)
        for index in range(num_buckets):
            self._store.delete_key(key(self.spec.refit_id, "ready", index))
        stale = self._keys("attached") + [
            k for i in range(num_buckets) for k in self._keys("done", i)
        ]
        for name in stale:
            self._store.delete_key(name)
        released = self._keys("released")
        what = "the receivers to release the buffers"
        wait_signals(self._store, released, self.spec.timeout_s, what)
        for name in released:
            self._store.delete_key(name)

    def abort(self, message: str) -> None:
        keys = [key(self.spec.refit_id, "ready", i) for i in range(len(self.spec.plan.buckets))]
        if keys:
            set_signals(self._store, keys, abort_signal(message))


class ColocatedReceiver(RefitReceiver):
    """The receivers' signals of one colocated refit; the transport maps the memory."""

    def __init__(self, spec: RefitSpec, device: torch.device, rank: int) -> None:
        super().__init__(spec, device, rank)
        if device.type != spec.device_type:
            raise ValueError(
                f"colocated refit: the trainer's buffers are on {spec.device_type} but this "
                f"receiver is on {device}; use the trainer's device type or transport=split"
            )
        self._store: dist.TCPStore | None = None
        self._batch_stop = {b.start: b.stop for b in ready_batches(self._packed)}
        self._ready_until = 0  # the buckets before it have had their ready signal read

    def _begin(self) -> None:
        spec = self.spec
        self._store = connect_store(spec.store_host, spec.store_port, spec.store_id, spec.timeout_s)
        attached = self._attach()
        self._store.set(key(spec.refit_id, "attached", self.rank), attached)

    def _wait_bucket(self, index: int) -> torch.Tensor:
        assert self._store is not None, "attached first"
        if index >= self._ready_until:  # the first bucket of a batch: read the batch's signals
            batch = range(index, self._batch_stop[index])
            keys = [key(self.spec.refit_id, "ready", i) for i in batch]
            what = f"the trainer to pack bucket {index}"
            wait_signals(self._store, keys, self.spec.timeout_s, what)
            self._ready_until = batch.stop
        return self._slot(index)

    def _done_bucket(self, index: int) -> None:
        assert self._store is not None, "attached first"
        self._store.set(key(self.spec.refit_id, "done", index, self.rank), "1")

    def _end(self, completed: bool) -> None:
        self._detach()  # before "released": the trainer may free its memory after it
        if self._store is None:
            return  # never attached: nothing to tell
        spec = self.spec
        keys, value = [], "1"
        if not completed:  # whatever the sender waits for now ends its wait
            value = abort_signal(f"receiver rank {self.rank} stopped before the end of the refit")
            keys = [key(spec.refit_id, "done", i, self.rank) for i in range(len(spec.plan.buckets))]
            keys.append(key(spec.refit_id, "attached", self.rank))
        keys.append(key(spec.refit_id, "released", self.rank))
        try:
            set_signals(self._store, keys, value)
        except dist.DistError as error:  # the trainer is gone: nothing left to tell it
            logger.warning("refit %d: could not signal the trainer: %s", spec.refit_id, error)

    def _abort_message(self) -> str:
        """The sender's message if it aborted the refit (it sets every "ready" signal to its
        abort, where an ended refit's signals are deleted), else ""."""
        assert self._store is not None, "connected first"
        ready = key(self.spec.refit_id, "ready", 0)
        if not self.spec.plan.buckets or not self._store.check([ready]):
            return ""
        value = self._store.get(ready)
        return value[len(ABORT) :].decode() if value.startswith(ABORT) else ""

    # Transport hooks.
    def _attach(self) -> str:
        """Map the refit's memory; the value of this receiver's "attached" signal."""
        raise NotImplementedError

    def _slot(self, index: int) -> torch.Tensor:
        """After bucket ``index``'s ready signal: the buffer holding its packed pieces."""
        raise NotImplementedError

    def _detach(self) -> None:
        """Unmap everything (every copy out of the sender's memory has finished)."""
        raise NotImplementedError
