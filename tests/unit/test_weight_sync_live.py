"""Live-refit planning and reading (``weight_sync.live``) on the CPU: a tensor's storage stands
in for one of the sender's segments, so the runs ``prepare()`` plans and the receiver's reads
out of them are checked without CUDA (tests/gpu runs the same code through CUDA IPC)."""

from __future__ import annotations

import torch

from tandem.tensors import TargetRuns, device_copies
from tandem.weight_sync import metadata_of, plan_buckets
from tandem.weight_sync.buckets import flat_bytes
from tandem.weight_sync.live import (
    InPlaceReader,
    Run,
    in_place_bytes,
    packed_pieces,
    plan_runs,
    ready_batches,
    run_indices,
)

CPU = torch.device("cpu")


def laid_out(seed: int) -> dict[str, torch.Tensor]:
    """Tensors back to back in one allocation (as a trainer's after ``onload()``), sizes
    multiples of 256 bytes (no gaps); ``big`` is split over three 64 KiB buckets."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"embed": torch.randn(64, 128, generator=gen).to(torch.bfloat16)}  # 16 KiB
    tensors["big"] = torch.randn(160, 256, generator=gen)  # 160 KiB
    for i in range(6):
        tensors[f"layers.{i}.w"] = torch.randn(64, 64, generator=gen)  # 16 KiB
        tensors[f"layers.{i}.norm"] = torch.randn(128, generator=gen).to(torch.bfloat16)
    return dict(zip(tensors, device_copies(list(tensors.values()), CPU), strict=True))


class Storages:
    """``live.Locate`` over CPU storages: each storage a segment, numbered as first found;
    ``rejected`` names storages that cannot be shared (memory of another allocator)."""

    def __init__(self, rejected: tuple[torch.Tensor, ...] = ()) -> None:
        self.bases: list[int] = []
        self.storages: list[torch.Tensor] = []
        self.rejected = {t.untyped_storage().data_ptr() for t in rejected}
        self.calls = 0

    def __call__(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        self.calls += 1
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        if base in self.rejected:
            return None
        if base not in self.bases:
            self.bases.append(base)
            raw = torch.empty(0, dtype=torch.uint8)
            self.storages.append(raw.set_(storage, 0, (storage.nbytes(),), (1,)))
        return self.bases.index(base), tensor.data_ptr() - base, storage.nbytes()

    def segment(self, segment: int) -> torch.Tensor:
        return self.storages[segment]


def test_a_laid_out_model_is_one_run_per_bucket() -> None:
    state = laid_out(0)
    plan = plan_buckets(metadata_of(state.items()), 2**16)
    locate = Storages()
    runs = plan_runs(plan, list(state.values()), locate)
    assert len(runs) == len(plan.buckets) > 4
    assert all(len(bucket_runs) == 1 for bucket_runs in runs)
    assert locate.calls == len(plan.buckets)  # the rest grew runs by a pointer comparison
    assert all(not pieces for pieces in packed_pieces(plan, runs))
    assert in_place_bytes(plan, runs) == plan.total_bytes
    big = list(state).index("big")  # split: a run of it in each of its buckets
    assert [r[0].first for r in runs if big in run_indices(r)] == [big] * 3
    assert ready_batches(packed_pieces(plan, runs)) == (range(len(plan.buckets)),)


def test_what_cannot_be_read_in_place_is_packed() -> None:
    state = laid_out(1)
    state["layers.2.w"] = state["layers.2.w"].t()  # not contiguous
    state["layers.4.w"] = state["layers.4.w"].clone()  # elsewhere: a run of its own
    other = torch.randn(32)
    state["layers.5.norm"] = other  # memory the transport cannot share
    plan = plan_buckets(metadata_of(state.items()), 2**16)
    runs = plan_runs(plan, list(state.values()), Storages(rejected=(other,)))
    names = [meta.name for meta in plan.tensors]
    shared = set().union(*(run_indices(r) for r in runs))
    assert {names[i] for i in set(range(len(names))) - shared} == {"layers.2.w", "layers.5.norm"}
    clone = names.index("layers.4.w")
    assert any(run.first == clone and run.count == 1 and run.offset == 0 for r in runs for run in r)
    packed = packed_pieces(plan, runs)
    assert [p.tensor_index for pieces in packed for p in pieces] == [
        names.index("layers.2.w"),
        names.index("layers.5.norm"),
    ]
    batches = ready_batches(packed)  # a bucket that packs opens a batch; in-place ones join
    assert [b.start for b in batches] == [0] + [i for i, p in enumerate(packed) if p and i]
    assert sum(len(b) for b in batches) == len(plan.buckets)
    assert in_place_bytes(plan, runs) == plan.total_bytes - 64 * 64 * 4 - 32 * 4


def test_the_receiver_reads_the_runs_bit_exact() -> None:
    """Views (``iter_weights``) and run copies (``copy_into``) out of the sender's memory, as a
    receiver makes them from the spec's runs, bucket by bucket."""
    state = laid_out(2)
    state["layers.1.w"] = state["layers.1.w"].clone()  # a second segment
    plan = plan_buckets(metadata_of(state.items()), 2**16)
    locate = Storages()
    runs = plan_runs(plan, list(state.values()), locate)
    assert len(locate.storages) == 2
    reader = InPlaceReader(plan, locate.segment)
    targets = TargetRuns(device_copies([torch.zeros_like(t) for t in state.values()], CPU))
    copies = 0
    views: dict[int, torch.Tensor] = {}
    for bucket, bucket_runs in zip(plan.buckets, runs, strict=True):
        completed = [p.tensor_index for p in bucket.pieces if p.is_last]
        views.update(reader.views(bucket_runs, completed))
        copies += reader.copy(bucket_runs, bucket, targets)
    for i, tensor in enumerate(state.values()):
        assert torch.equal(flat_bytes(views[i]), flat_bytes(tensor)), plan.tensors[i].name
        assert torch.equal(flat_bytes(targets.tensors[i]), flat_bytes(tensor)), plan.tensors[i].name
    # a run per bucket that completes a tensor, plus the bucket the second segment splits
    completing = [b for b in plan.buckets if any(p.is_last for p in b.pieces)]
    assert copies == len(completing) + 1
    reader.clear()


def test_run_indices_and_empty_plans() -> None:
    assert run_indices((Run(3, 2, 0, 0), Run(7, 1, 1, 64))) == {3, 4, 7}
    empty = plan_buckets([], 2**16)
    assert plan_runs(empty, [], Storages()) == ()
    assert packed_pieces(empty, ()) == ()
    assert ready_batches(()) == ()


def test_a_refit_read_wholly_in_place_sends_without_buffers() -> None:
    """CUDA IPC of live tensors allocates no slots when nothing is packed: sending asks for
    none (it once asked for slot 0 of an empty list on every bucket batch) and publishes every
    bucket, the stream finished before the last publish."""
    from tandem.weight_sync.base import RefitSpec, SenderRefit, _send_buckets

    state = laid_out(2)
    plan = plan_buckets(metadata_of(state.items()), 2**16)
    runs = plan_runs(plan, list(state.values()), Storages())
    spec = RefitSpec(0, "colocated", "cpu", plan, "127.0.0.1", 0, 1, 1.0, runs=runs)
    events: list[str] = []

    class NoSlots(SenderRefit):
        def buffer(self, slot: int) -> torch.Tensor:
            raise AssertionError(f"slot {slot} asked for: nothing is packed")

        def publish(self, indices: range) -> None:
            events.append(f"publish {indices.start}-{indices.stop}")

        def wait_slot(self, index: int) -> None:
            raise AssertionError("no slot to wait for")

    class Source:
        def tensor(self, index: int) -> torch.Tensor:
            raise AssertionError("an in-place tensor was read for packing")

        def finish(self) -> None:
            events.append("finish")

    _send_buckets(NoSlots(spec), Source())  # type: ignore[arg-type]
    assert events == ["finish", f"publish 0-{len(plan.buckets)}"]
