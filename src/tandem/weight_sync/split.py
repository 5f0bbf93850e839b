"""Split refit: trainer and generators own separate devices (or nodes).

Weights travel over a standalone process group — a TCPStore served by trainer rank 0 plus a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) created directly, never the trainer's
default group — with rank 0 = trainer rank 0 and ranks 1..N = generator workers. Buckets are
broadcast from rank 0 with async ops: the sender packs bucket i+1 while bucket i is on the wire;
each receiver posts bucket i+1 into its second buffer before yielding bucket i.

The group is created on the first refit and cached by both sides. A failed refit leaves it out
of step, so the sender moves to a new group generation for the next refit; receivers that were
blocked in the failed one time out after ``timeout_s`` (the collective cannot be interrupted).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.weight_sync.base import (
    NUM_SLOTS,
    RefitError,
    RefitReceiver,
    RefitSender,
    RefitSpec,
    connect_store,
    slot_layout,
)
from tandem.weight_sync.buckets import BucketPlan

CollectiveGroup = Any
"""ProcessGroupGloo or ProcessGroupNCCL (the latter exists only in CUDA builds of torch)."""
_GroupKey = tuple[str, int, int, int]
_RECEIVER_GROUPS: dict[_GroupKey, CollectiveGroup] = {}
"""Receiver-side groups cached per (store host, port, generation, rank) in this process."""


def _new_group(
    store: dist.Store, generation: int, rank: int, size: int, device: torch.device, timeout_s: float
) -> CollectiveGroup:
    prefixed = dist.PrefixStore(f"split/{generation}", store)
    timeout = timedelta(seconds=timeout_s)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, size, options)
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    except (RuntimeError, dist.DistError) as error:
        raise RefitError(
            f"refit process group (rank {rank} of {size}) did not form within {timeout_s:.0f} s: "
            f"{error}. Every generator worker must call make_receiver(spec, device, rank) with "
            "ranks 1..num_receivers while the trainer sends"
        ) from error


def _broadcast(group: CollectiveGroup, tensor: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


class SplitSender(RefitSender):
    """Broadcasts buckets from trainer rank 0 to ``num_receivers`` generator workers."""

    transport = "split"

    def __init__(
        self,
        bucket_bytes: int,
        device: torch.device,
        num_receivers: int,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(bucket_bytes, device, num_receivers, timeout_s, host)
        self._generation = 0
        self._group: CollectiveGroup | None = None
        self._buffers: list[torch.Tensor] = []
        self._works: list[dist.Work | None] = [None] * NUM_SLOTS

    def _make_spec(self, refit_id: int, plan: BucketPlan) -> RefitSpec:
        return RefitSpec(
            refit_id=refit_id,
            transport="split",
            device_type=self.device.type,
            plan=plan,
            store_host=self._host,
            store_port=self._store.port,
            num_receivers=self.num_receivers,
            timeout_s=self.timeout_s,
            group_generation=self._generation,
        )

    def _begin(self, spec: RefitSpec, live: bool) -> None:
        if self._group is None:
            size = self.num_receivers + 1
            self._group = _new_group(
                self._store, spec.group_generation, 0, size, self.device, spec.timeout_s
            )
        size, num_slots = slot_layout(spec.plan)
        self._buffers = [
            torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(num_slots)
        ]

    def _buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def _publish(self, spec: RefitSpec, index: int, slot: int, num_bytes: int) -> None:
        assert self._group is not None
        self._works[slot] = _broadcast(self._group, self._buffers[slot][:num_bytes])

    def _wait_slot(self, spec: RefitSpec, index: int) -> None:
        work, self._works[index % NUM_SLOTS] = self._works[index % NUM_SLOTS], None
        assert work is not None, "every published bucket has a pending broadcast"
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise RefitError(
                f"refit {spec.refit_id}: broadcast of bucket {index} failed ({error}); a "
                "generator worker probably died or stopped receiving"
            ) from error

    def _end(self, spec: RefitSpec) -> None:
        pass

    def _abort(self, spec: RefitSpec, message: str) -> None:
        # The group is now out of step with the receivers: the next refit forms a new one.
        self._group = None
        self._generation += 1

    def _release(self, spec: RefitSpec) -> None:
        self._works = [None] * NUM_SLOTS
        self._buffers = []

    def close(self) -> None:
        self._group = None


class SplitReceiver(RefitReceiver):
    """Joins the sender's group as ``rank`` and receives every bucket into its own buffers."""

    def _group_key(self) -> _GroupKey:
        spec = self.spec
        return (spec.store_host, spec.store_port, spec.group_generation, self.rank)

    def _begin(self) -> None:
        spec = self.spec
        key = self._group_key()
        if key not in _RECEIVER_GROUPS:
            for stale in [k for k in _RECEIVER_GROUPS if k[:2] == key[:2] and k[3] == key[3]]:
                del _RECEIVER_GROUPS[stale]
            store = connect_store(spec.store_host, spec.store_port, spec.timeout_s)
            _RECEIVER_GROUPS[key] = _new_group(
                store,
                spec.group_generation,
                self.rank,
                spec.num_receivers + 1,
                self.device,
                spec.timeout_s,
            )
        self._group = _RECEIVER_GROUPS[key]
        buckets = spec.plan.buckets
        size, num_slots = slot_layout(spec.plan)
        self._buffers = [
            torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(num_slots)
        ]
        self._works: dict[int, dist.Work] = {}
        if buckets:
            self._post(0)

    def _post(self, index: int) -> None:
        num_bytes = self.spec.plan.buckets[index].used_bytes
        buffer = self._buffers[index % NUM_SLOTS][:num_bytes]
        self._works[index] = _broadcast(self._group, buffer)

    def _wait_bucket(self, index: int) -> torch.Tensor:
        try:
            self._works.pop(index).wait()
        except (RuntimeError, dist.DistError) as error:
            raise RefitError(
                f"refit {self.spec.refit_id}: receiving bucket {index} failed ({error}); the "
                "trainer probably died or aborted the refit"
            ) from error
        if index + 1 < len(self.spec.plan.buckets):
            # The other slot held bucket index-1, which the consumer has finished with.
            self._post(index + 1)
        return self._buffers[index % NUM_SLOTS]

    def _done_bucket(self, index: int) -> None:
        pass

    def _end(self, completed: bool) -> None:
        self._works = {}
        self._buffers = []
        if not completed:
            _RECEIVER_GROUPS.pop(self._group_key(), None)
