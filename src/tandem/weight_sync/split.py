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

import dataclasses
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.weight_sync.base import NUM_SLOTS, RefitSender, RefitSpec, SenderRefit, slot_layout
from tandem.weight_sync.receiver import RefitReceiver
from tandem.weight_sync.signals import RefitError, connect_store

CollectiveGroup = Any
"""ProcessGroupGloo or ProcessGroupNCCL (the latter exists only in CUDA builds of torch)."""
_GroupKey = tuple[str, int, str, int, int]
_RECEIVER_GROUPS: dict[_GroupKey, CollectiveGroup] = {}
"""Receiver-side groups cached per (store host, port, id, generation, rank) in this process."""


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
    """Broadcasts buckets from trainer rank 0 to ``num_receivers`` generator workers. The group
    outlives a refit; a failed refit leaves it out of step, so the next forms a new one."""

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

    def _open(self, spec: RefitSpec, live: list[torch.Tensor]) -> SenderRefit:
        return _SplitRefit(dataclasses.replace(spec, group_generation=self._generation), self)

    def group(self, spec: RefitSpec) -> CollectiveGroup:
        """The group of ``spec``'s generation, formed with the receivers on first use."""
        if self._group is None:
            size = self.num_receivers + 1
            self._group = _new_group(
                self._store, spec.group_generation, 0, size, self.device, spec.timeout_s
            )
        return self._group

    def drop_group(self) -> None:
        """The group is out of step with the receivers: the next refit forms a new one."""
        self._group = None
        self._generation += 1

    def close(self) -> None:
        self._group = None


class _SplitRefit(SenderRefit):
    def __init__(self, spec: RefitSpec, sender: SplitSender) -> None:
        super().__init__(spec)
        self._sender = sender
        self._group: CollectiveGroup | None = None
        self._buffers: list[torch.Tensor] = []
        self._works: list[dist.Work | None] = [None] * NUM_SLOTS

    def begin(self) -> None:
        self._group = self._sender.group(self.spec)
        size, num_slots = slot_layout(self.spec.plan)
        device = self._sender.device
        self._buffers = [
            torch.empty(size, dtype=torch.uint8, device=device) for _ in range(num_slots)
        ]

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def publish(self, indices: range) -> None:
        assert self._group is not None, "begin() forms the group"
        for index in indices:
            num_bytes = self.spec.plan.buckets[index].used_bytes
            buffer = self._buffers[index % NUM_SLOTS][:num_bytes]
            self._works[index % NUM_SLOTS] = _broadcast(self._group, buffer)

    def wait_slot(self, index: int) -> None:
        work, self._works[index % NUM_SLOTS] = self._works[index % NUM_SLOTS], None
        assert work is not None, "every published bucket has a pending broadcast"
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise RefitError(
                f"refit {self.spec.refit_id}: broadcast of bucket {index} failed ({error}); a "
                "generator worker probably died or stopped receiving"
            ) from error

    def abort(self, message: str) -> None:
        self._sender.drop_group()

    def close(self) -> None:
        self._works = [None] * NUM_SLOTS
        self._buffers = []


class SplitReceiver(RefitReceiver):
    """Joins the sender's group as ``rank`` and receives every bucket into its own buffers."""

    def __init__(self, spec: RefitSpec, device: torch.device, rank: int) -> None:
        super().__init__(spec, device, rank)
        self._group: CollectiveGroup | None = None
        self._buffers: list[torch.Tensor] = []
        self._works: dict[int, dist.Work] = {}

    def _group_key(self) -> _GroupKey:
        spec = self.spec
        return (spec.store_host, spec.store_port, spec.store_id, spec.group_generation, self.rank)

    def _begin(self) -> None:
        spec = self.spec
        key = self._group_key()
        if key not in _RECEIVER_GROUPS:
            for stale in [k for k in _RECEIVER_GROUPS if k[:2] == key[:2] and k[-1] == key[-1]]:
                del _RECEIVER_GROUPS[stale]
            store = connect_store(spec.store_host, spec.store_port, spec.store_id, spec.timeout_s)
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
