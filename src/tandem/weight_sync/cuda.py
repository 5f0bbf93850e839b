"""Colocated refit on CUDA: the receivers map the trainer's allocations through CUDA IPC.

Two kinds of the trainer's memory are shared, each as whole allocations (*segments*, see
``cuda_ipc``) named in the spec and mapped by the receivers as they attach:

- the two bucket slots (one allocation), made in ``prepare()`` only when some piece is packed:
  a refit read wholly in place allocates nothing;
- the live tensors' allocations (``prepare(metadata, live_tensors)``), which the receivers copy
  straight out of (``live.plan_runs``): one copy per byte instead of two.

The store signals say that copies were *enqueued*, not finished: each side records an
interprocess CUDA event after its copies and the other side's stream waits for that event
before touching the slot, so neither process blocks its CPU on the GPU per bucket and packing,
signalling and the receivers' copies overlap. An event waited on is always recorded first: a
"ready" signal is set only after the record of its slot's event (which also orders the
receivers' reads of live tensors after the trainer's last writes).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.distributed as dist

from tandem.weight_sync.base import NUM_SLOTS, RefitSender, RefitSpec, SenderRefit, slot_layout
from tandem.weight_sync.colocated import ColocatedReceiver, ColocatedRefit, slots_of
from tandem.weight_sync.cuda_ipc import CudaIpcError, SegmentTable, close_segment, open_segment
from tandem.weight_sync.live import plan_runs

logger = logging.getLogger(__name__)


def _locate(
    table: SegmentTable, device_index: int, tensor: torch.Tensor
) -> tuple[int, int, int] | None:
    """``live.Locate`` over this device's segments: memory of another device, or memory that
    CUDA IPC cannot share (another allocator), is packed."""
    if not tensor.is_cuda or tensor.get_device() != device_index:
        return None
    try:
        segment, offset, _ = table.locate(tensor.data_ptr())
    except CudaIpcError:
        return None
    return segment, offset, table.by_id[segment].size


class CudaIpcSender(RefitSender):
    """Shares bucket slots and live tensors with the receivers of the same GPU."""

    transport = "colocated"

    def _open(self, spec: RefitSpec, live: list[torch.Tensor]) -> SenderRefit:
        return _CudaRefit(spec, self._store, self.device, live)


class _CudaRefit(ColocatedRefit):
    def __init__(
        self, spec: RefitSpec, store: dist.TCPStore, device: torch.device, live: list[torch.Tensor]
    ) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        table = SegmentTable(device)
        if live:
            spec = dataclasses.replace(
                spec,
                runs=plan_runs(spec.plan, live, functools.partial(_locate, table, device.index)),
            )
        size, num_slots = slot_layout(spec.plan)
        super().__init__(spec, store)  # works out what is packed
        self._buffers: list[torch.Tensor] = []
        slots = None
        if any(self.packed):
            whole = torch.empty(size * num_slots, dtype=torch.uint8, device=device)
            try:
                segment, offset, _ = table.locate(whole.data_ptr())
            except CudaIpcError as error:
                raise CudaIpcError(
                    f"colocated refit cannot share its bucket memory with the generators: "
                    f"{error}. CUDA IPC shares cudaMalloc'd memory only; unset "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the trainer's environment"
                ) from error
            self._buffers, slots = slots_of(whole, size, num_slots), (segment, offset)
        self._packed_events = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
        self._consumed: list[list[torch.cuda.Event]] = []  # per receiver, per slot
        self.spec = dataclasses.replace(
            spec,
            events=tuple(event.ipc_handle() for event in self._packed_events),
            segments=tuple((segment.handle, segment.size) for segment in table.by_id),
            slots=slots,
        )

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def publish(self, indices: range) -> None:
        stream = torch.cuda.current_stream(self._device)
        for slot in sorted({i % NUM_SLOTS for i in indices}):
            self._packed_events[slot].record(stream)
        super().publish(indices)

    def _on_attached(self, values: list[bytes]) -> None:
        # each receiver's attach signal carries the IPC handles of its events, per slot
        self._consumed = [
            [
                torch.cuda.Event.from_ipc_handle(self._device, bytes.fromhex(handle))
                for handle in value.decode().split(",")
            ]
            for value in values
        ]

    def wait_slot(self, index: int) -> None:
        super().wait_slot(index)
        stream = torch.cuda.current_stream(self._device)  # the slot's next packing waits too
        for events in self._consumed:
            stream.wait_event(events[index % NUM_SLOTS])

    def close(self) -> None:
        allocated = bool(self._buffers)
        self._buffers, self._packed_events, self._consumed = [], [], []
        if allocated:  # hand the slots' memory back
            torch.cuda.empty_cache()


class CudaIpcReceiver(ColocatedReceiver):
    """Maps the trainer's segments, and orders its copies with the trainer's events."""

    def __init__(self, spec: RefitSpec, device: torch.device, rank: int) -> None:
        super().__init__(spec, device, rank)
        self._mapped: list[tuple[int, torch.Tensor]] = []  # by segment id: pointer, bytes
        self._buffers: list[torch.Tensor] = []
        self._packed_events: list[torch.cuda.Event] = []
        self._consumed: list[torch.cuda.Event] = []
        self._nothing = torch.empty(0, dtype=torch.uint8, device=device)

    def _attach(self) -> str:
        spec = self.spec
        for handle, size in spec.segments:
            self._mapped.append(open_segment(handle, size, self.device))
        if spec.slots is not None:
            segment, offset = spec.slots
            size, num_slots = slot_layout(spec.plan)
            whole = self._segment(segment)[offset : offset + size * num_slots]
            self._buffers = slots_of(whole, size, num_slots)
        self._packed_events = [
            torch.cuda.Event.from_ipc_handle(self.device, h) for h in spec.events
        ]
        self._consumed = [torch.cuda.Event(interprocess=True) for _ in spec.events]
        return ",".join(event.ipc_handle().hex() for event in self._consumed)

    def _segment(self, segment: int) -> torch.Tensor:
        return self._mapped[segment][1]

    def _slot(self, index: int) -> torch.Tensor:
        # the consumers copy on the current stream, after the trainer's packing
        torch.cuda.current_stream(self.device).wait_event(self._packed_events[index % NUM_SLOTS])
        return self._buffers[index % NUM_SLOTS] if self._packed[index] else self._nothing

    def _done_bucket(self, index: int) -> None:
        # the consumers' copies of this bucket are enqueued: the slot is free once they ran
        self._consumed[index % NUM_SLOTS].record(torch.cuda.current_stream(self.device))
        super()._done_bucket(index)

    def _detach(self) -> None:
        self._buffers, self._packed_events, self._consumed = [], [], []
        torch.cuda.synchronize(self.device)  # every copy out of the trainer's memory has run
        for ptr, _ in self._mapped:
            try:
                close_segment(ptr, self.device)
            except CudaIpcError as error:
                logger.warning("refit %d: %s", self.spec.refit_id, error)
        self._mapped = []
