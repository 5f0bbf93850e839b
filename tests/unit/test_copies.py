"""Laying tensors out back to back (``device_copies``) and copying batches of them
(``copy_tensors``, ``coalesce``), on the CPU; the same code runs on a GPU in tests/gpu."""

import pytest
import torch

from tandem.tensors.copies import (
    ALIGN_BYTES,
    FOREACH_MAX_BYTES,
    TargetRuns,
    coalesce,
    copy_tensors,
    device_copies,
    pack_parameters,
    span,
)
from tandem.weight_sync.buckets import flat_bytes, plan_buckets

CPU = torch.device("cpu")


def _mixed(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, generator=gen),  # 60 bytes: the next one starts after a gap
        torch.randn(128, generator=gen).to(torch.bfloat16),  # 256 bytes
        torch.randint(0, 9, (32,), generator=gen),  # int64, 256 bytes
        torch.tensor(7, dtype=torch.int64),
        torch.randn(6, 4, generator=gen).t(),  # strided
        torch.zeros(0, 3),
        torch.randn(512, generator=gen).to(torch.bfloat16),
    ]


def _assert_only_tensors_written(arena: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Every byte of ``arena`` (filled with 0xAB first) outside ``tensors`` is still 0xAB."""
    covered = torch.zeros(arena.numel(), dtype=torch.bool)
    for tensor in tensors:
        if tensor.untyped_storage().data_ptr() == arena.data_ptr():
            start = tensor.data_ptr() - arena.data_ptr()
            covered[start : start + tensor.nbytes] = True
    assert bool((arena[~covered] == 0xAB).all())


def test_device_copies_lay_contiguous_tensors_back_to_back_in_one_allocation() -> None:
    tensors = _mixed(0)
    copies = device_copies(tensors, CPU)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert torch.equal(tensor, copy) and copy.stride() == tensor.stride()
        assert copy.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    contiguous = [c for c in copies if c.is_contiguous()]
    base = contiguous[0].untyped_storage().data_ptr()
    assert {c.untyped_storage().data_ptr() for c in contiguous} == {base}
    assert copies[4].untyped_storage().data_ptr() != base  # the strided one: its own
    # In order, each at the next ALIGN_BYTES boundary after the one before (an empty tensor
    # takes no bytes, and reports no address).
    offsets, expected = [c.data_ptr() - base for c in contiguous if c.numel()], [0]
    for c in contiguous[:-1]:
        if c.nbytes:
            expected.append(expected[-1] + -(-c.nbytes // ALIGN_BYTES) * ALIGN_BYTES)
    assert offsets == expected


def test_coalesce_joins_pairs_back_to_back_on_both_sides() -> None:
    srcs = device_copies(_mixed(1), CPU)
    dsts = device_copies([torch.zeros_like(t) for t in srcs], CPU)
    # 0 ends at 60 bytes, before the boundary 1 starts at: a gap. 1, 2, 3 are back to back;
    # 4 is strided; 5 is empty (after 4, nothing to join) and 6 follows it.
    assert coalesce(dsts, srcs) == [range(0, 1), range(1, 4), range(4, 5), range(5, 6), range(6, 7)]
    # A destination laid out differently breaks the runs where the sides stop lining up.
    loose = [torch.zeros_like(t) for t in srcs]
    assert all(len(run) == 1 for run in coalesce(loose, srcs))
    # A cast or a reshaped destination is never part of a run.
    cast = list(dsts)
    cast[2] = torch.zeros(32, dtype=torch.float64)
    assert [len(run) for run in coalesce(cast, srcs)] == [1] * 7
    with pytest.raises(ValueError):
        coalesce(dsts, srcs[:-1])
    # An empty pair inside a run joins it.
    srcs.insert(2, torch.zeros(0, dtype=torch.bfloat16))
    dsts.insert(2, torch.zeros(0, dtype=torch.bfloat16))
    assert coalesce(dsts, srcs)[1] == range(1, 5)


def test_a_run_stays_inside_the_storage_it_started_in() -> None:
    """Two storages back to back in memory (slices of one) are two runs: a byte copy must not
    cross from one allocation into the next."""
    halves = [torch.empty(1024, dtype=torch.uint8).untyped_storage() for _ in range(2)]

    def tensors(storage: torch.UntypedStorage) -> list[torch.Tensor]:
        return [torch.empty(0).set_(storage[i * 512 : (i + 1) * 512]) for i in range(2)]

    dsts, srcs = tensors(halves[0]), tensors(halves[1])
    assert dsts[1].data_ptr() == dsts[0].data_ptr() + dsts[0].nbytes
    assert coalesce(dsts, srcs) == [range(0, 1), range(1, 2)]
    joined = [
        torch.empty(0).set_(halves[0], 0, (128,)),
        torch.empty(0).set_(halves[0], 128, (128,)),
    ]
    assert coalesce(joined, srcs) == [range(0, 1), range(1, 2)]  # the source side still splits
    assert coalesce(joined, [t.clone() for t in joined]) == [range(0, 1), range(1, 2)]
    same = [torch.empty(0).set_(halves[1], 0, (128,)), torch.empty(0).set_(halves[1], 128, (128,))]
    assert coalesce(joined, same) == [range(0, 2)]


def test_copy_tensors_between_layouts_copies_every_pair_and_nothing_else() -> None:
    """Runs copy their bytes and no byte outside the tensors: the gaps of the destination
    layout keep what they held."""
    srcs = device_copies(_mixed(2), CPU)
    dsts = device_copies([torch.zeros_like(t) for t in srcs], CPU)
    arena = torch.empty(0, dtype=torch.uint8).set_(dsts[0].untyped_storage())
    arena.fill_(0xAB)
    copy_tensors(dsts, srcs)
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src)
    _assert_only_tensors_written(arena, dsts)


def test_copy_tensors_out_of_a_packed_bucket_into_a_laid_out_model() -> None:
    """A packed bucket has the layout of ``device_copies``: its tensors copy in one run."""
    gen = torch.Generator().manual_seed(3)
    model = device_copies([torch.zeros(64, 8), torch.zeros(64), torch.zeros(16, 16)], CPU)
    plan = plan_buckets([(str(i), t.shape, t.dtype) for i, t in enumerate(model)], 1 << 20)
    (bucket,) = plan.buckets
    buffer = torch.empty(bucket.used_bytes, dtype=torch.uint8)
    values = [torch.randn(t.shape, generator=gen) for t in model]
    views = []
    for piece, value in zip(bucket.pieces, values, strict=True):
        view = buffer[piece.bucket_offset : piece.bucket_offset + piece.num_bytes]
        views.append(view.view(torch.float32).view(value.shape).copy_(value))
    assert coalesce(model, views) == [range(0, 3)]
    assert copy_tensors(model, views) == 1  # launches
    for got, value in zip(model, values, strict=True):
        assert torch.equal(got, value)


def test_copy_tensors_fuses_small_copies_and_still_copies_every_pair() -> None:
    """Small pairs go through ``_foreach_copy_`` (grouped by their pair of dtypes: a cast is a
    group of its own), strided destinations too; large ones through ``copy_``: every
    destination ends up equal."""
    gen = torch.Generator().manual_seed(0)
    big = FOREACH_MAX_BYTES // 4 + 1  # fp32 elements: one byte over the fused limit
    srcs = [
        torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        torch.randn(3, generator=gen),
        torch.randn(big, generator=gen),
        torch.randn(4, 4, generator=gen),  # cast into bf16
        torch.randint(0, 9, (6,), generator=gen),
        torch.randn(5, 7, generator=gen).to(torch.bfloat16),
    ]
    dsts = [
        torch.zeros(7, 5, dtype=torch.bfloat16),
        torch.zeros(3),
        torch.zeros(big),
        torch.zeros(4, 4, dtype=torch.bfloat16),
        torch.zeros(6, dtype=torch.int64),
        torch.zeros(7, 5, dtype=torch.bfloat16).t(),  # strided destination
    ]
    # the large one alone; the rest in one fused launch per pair of dtypes (bf16, f32, i64, and
    # f32 into bf16)
    assert copy_tensors(dsts, srcs) == 1 + 4
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src.to(dst.dtype))
    with pytest.raises(ValueError):
        copy_tensors(dsts, srcs[:-1])
    # casts of one pair of dtypes share a launch
    casts = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16)]
    values = [torch.randn(3, generator=gen), torch.randn(2, 2, generator=gen)]
    assert copy_tensors(casts, values) == 1
    assert all(torch.equal(c, v.to(torch.bfloat16)) for c, v in zip(casts, values, strict=True))


def test_target_runs_copy_ranges_of_destinations_out_of_packed_bytes() -> None:
    """A receiver fills runs of its tensors from a sender's bytes (the tensors back to back):
    destinations back to back take one copy, a gap or a strided one starts another, empty ones
    cost nothing, a range may start or end inside a run, and no byte outside the destinations
    is written."""
    gen = torch.Generator().manual_seed(4)
    values = [
        torch.zeros(0, 5),  # empty, before any run
        torch.randn(64, generator=gen),  # 256 bytes
        torch.randn(8, 16, generator=gen).to(torch.bfloat16),  # 256 bytes
        torch.zeros(0, 5),
        torch.randn(3, generator=gen),  # 12 bytes: the next destination starts after a gap
        torch.randn(16, generator=gen),
        torch.randn(4, 6, generator=gen),  # its destination is strided
        torch.randint(0, 9, (16,), generator=gen),
    ]
    src = torch.cat([flat_bytes(v) for v in values])
    dsts = device_copies([torch.zeros_like(v) for v in values], CPU)
    dsts[6] = torch.zeros(6, 4).t()
    arena = torch.empty(0, dtype=torch.uint8).set_(dsts[1].untyped_storage())
    arena.fill_(0xAB)
    runs = TargetRuns(dsts)
    assert runs.run_starts == [1, 5, 6, 7]  # 1-4 | gap | 5 | strided 6 | 7
    assert runs.copy(0, len(dsts), src) == 4
    for dst, value in zip(dsts, values, strict=True):
        assert torch.equal(dst, value)
    _assert_only_tensors_written(arena, dsts)
    # Ranges inside runs, as buckets cut them: tensors 2..5 are two copies (part of a run, 5).
    for dst in dsts:
        dst.zero_()
    assert runs.copy(2, 6, src[runs.starts[2] : runs.starts[6]]) == 2
    assert all(bool(d.eq(0).all()) for d in dsts[:2] + dsts[6:])
    assert all(torch.equal(d, v) for d, v in zip(dsts[2:6], values[2:6], strict=True))
    assert runs.copy(3, 4, src[:0]) == 0  # only an empty tensor
    with pytest.raises(ValueError, match="source bytes"):
        runs.copy(0, len(dsts), src[:-1])


def test_span_covers_tensors_laid_out_in_order_and_nothing_else() -> None:
    """``span`` of tensors ``device_copies`` laid out is one tensor over them (their gaps
    included) with each one's offset; out of order, of two dtypes, strided, empty or in two
    storages they have none."""
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(3, 5, generator=gen), torch.randn(64, generator=gen)]
    values.append(torch.randn(2, 8, generator=gen))
    laid = device_copies(values, CPU)
    found = span(laid)
    assert found is not None
    flat, offsets = found
    assert offsets == [0, ALIGN_BYTES // 4, 2 * ALIGN_BYTES // 4]  # 60 bytes, then aligned
    assert flat.data_ptr() == laid[0].data_ptr() and flat.numel() == offsets[-1] + 16
    for tensor, at in zip(laid, offsets, strict=True):
        assert torch.equal(flat[at : at + tensor.numel()].view(tensor.shape), tensor)
    later = span(laid[1:])
    assert later is not None and later[1] == [0, offsets[2] - offsets[1]]
    assert span(laid[::-1]) is None  # out of order
    assert span([laid[0], laid[0]]) is None  # overlapping
    assert span([*laid, torch.randn(4)]) is None  # another storage
    assert span(device_copies([values[0], values[1].double()], CPU)) is None  # two dtypes
    assert span(device_copies([values[0], torch.zeros(0)], CPU)) is None  # empty
    strided = device_copies([values[0], values[2].t()], CPU)
    assert span([strided[0], strided[0].t()]) is None
    assert span([]) is None


def test_pack_parameters_lays_parameters_out_and_keeps_their_objects() -> None:
    layers = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    params = list(layers.parameters())
    ids, values = [id(p) for p in params], [p.detach().clone() for p in params]
    params[1].requires_grad_(False)
    pack_parameters(params, CPU)
    assert [id(p) for p in layers.parameters()] == ids
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))
    assert [p.requires_grad for p in params] == [True, False, True]
    found = span(params)  # 12 and 3 floats, each at the next ALIGN_BYTES boundary
    assert found is not None and found[1] == [0, ALIGN_BYTES // 4, 2 * ALIGN_BYTES // 4]


def test_a_placement_tells_tensors_moved_alike_from_tensors_laid_out_otherwise() -> None:
    """``Placement.same``: where tensors lay when a layout was worked out. The same tensors
    again; the same layout in another storage (an onload, a wake); another spacing."""
    from tandem.tensors.packed import Placement

    def views(flat: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
        return [flat[at : at + 4] for at in offsets]

    one = views(torch.zeros(64), [0, 8, 20])
    placement = Placement()
    assert placement.same(one) == (False, False)  # nothing known yet
    assert placement.same(one) == (True, True)
    assert placement.same(views(torch.zeros(64), [0, 8, 20])) == (False, True)
    placement.same(one)
    assert placement.same(views(torch.zeros(64), [0, 9, 20])) == (False, False)
