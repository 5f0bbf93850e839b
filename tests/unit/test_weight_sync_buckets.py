"""Bucket planning, packing and unpacking (in one process; transports are tested elsewhere)."""

import subprocess
import sys

import pytest
import torch

from tandem.tensors import device_copies
from tandem.weight_sync.buckets import (
    ALIGN_BYTES,
    BucketPacker,
    BucketPlan,
    TensorMeta,
    flat_bytes,
    pack_piece,
    plan_buckets,
    unpack_bucket,
)


def _roundtrip(
    tensors: dict[str, torch.Tensor], bucket_bytes: int, packer: bool = False
) -> tuple[BucketPlan, dict]:
    """Pack every bucket of the plan into one buffer and unpack it, as the transports do
    (``packer``: through a ``BucketPacker``, as a sender does; else piece by piece)."""
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors.items()], bucket_bytes)
    values = list(tensors.values())
    out: dict[str, torch.Tensor] = {}
    partial: dict[int, torch.Tensor] = {}
    for bucket in plan.buckets:
        assert bucket.used_bytes <= bucket_bytes
        buffer = torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8)
        packing = BucketPacker(buffer)
        for piece in bucket.pieces:
            assert piece.bucket_offset % ALIGN_BYTES == 0
            if packer:
                packing.add(piece, values[piece.tensor_index])
            else:
                pack_piece(buffer, piece, values[piece.tensor_index])
        packing.flush()
        for index, view in unpack_bucket(buffer, bucket, plan, partial):
            assert view is not None
            out[plan.tensors[index].name] = view.clone()
    assert not partial
    return plan, out


def _assert_bit_exact(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(flat_bytes(got[name]), flat_bytes(tensor)), name


def test_exactly_full_bucket_then_next() -> None:
    metas = [
        ("a", (2**14,), torch.float32),
        ("b", (2**14,), torch.float32),
        ("c", (1,), torch.int8),
    ]
    plan = plan_buckets(metas, 2**17)  # a and b fill the bucket to the byte
    assert [len(b.pieces) for b in plan.buckets] == [2, 1]
    assert plan.buckets[0].used_bytes == 2**17


def test_one_tensor_per_bucket_when_each_nearly_fills_it() -> None:
    metas = [(f"w{i}", (2**14 - 1,), torch.float32) for i in range(3)]
    plan = plan_buckets(metas, 2**16)
    assert [[p.tensor_index for p in b.pieces] for b in plan.buckets] == [[0], [1], [2]]


@pytest.mark.parametrize("packer", [False, True])
def test_mixed_dtypes_and_scalars_roundtrip_bit_exact(packer: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(37, 5, generator=gen).to(torch.bfloat16),
        "f8": torch.randint(0, 256, (19, 3), generator=gen, dtype=torch.uint8).view(
            torch.float8_e4m3fn
        ),
        "step": torch.tensor(123456789012, dtype=torch.int64),  # 0-dim int64
        "scale": torch.tensor(0.5),  # 0-dim fp32
        "empty": torch.empty(0, 4),
        "f32": torch.randn(3, 7, 11, generator=gen),
        "mask": torch.tensor([True, False, True]),
    }
    plan, out = _roundtrip(tensors, 2**16, packer)
    assert len(plan.buckets) == 1
    _assert_bit_exact(tensors, out)
    laid = dict(
        zip(tensors, device_copies(list(tensors.values()), torch.device("cpu")), strict=True)
    )
    _assert_bit_exact(tensors, _roundtrip(laid, 2**16, packer)[1])


@pytest.mark.parametrize("packer", [False, True])
def test_tensor_larger_than_bucket_is_split_and_reassembled(packer: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = {
        "small": torch.randn(10, generator=gen),
        "embed": torch.randn(300, 111, generator=gen).to(torch.bfloat16),  # 66,600 B > 65,536
        "huge": torch.randn(50_001, generator=gen),  # 200,004 B: 4 buckets
        "tail": torch.randn(7, generator=gen),
    }
    plan, out = _roundtrip(tensors, 2**16, packer)
    split = [p for b in plan.buckets for p in b.pieces if not p.is_whole]
    assert {plan.tensors[p.tensor_index].name for p in split} == {"embed", "huge"}
    assert all(p.num_bytes % 2 == 0 for p in split)  # element boundaries
    _assert_bit_exact(tensors, out)
    laid = dict(
        zip(tensors, device_copies(list(tensors.values()), torch.device("cpu")), strict=True)
    )
    _assert_bit_exact(tensors, _roundtrip(laid, 2**16, packer)[1])


def test_a_stream_laid_out_like_its_bucket_packs_in_one_copy() -> None:
    """Views of one allocation laid out as the bucket lays them out (``device_copies``: the
    same alignment) pack in one copy, the padding with them; tensors of their own, a strided
    one, or a piece that does not follow the last in the bucket start a copy of their own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += func.overloadpacket.__name__ == "copy_"
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(2)
    values = [torch.randn(3, 5, generator=gen), torch.randn(64, generator=gen).bfloat16()]
    values += [torch.randn(7, generator=gen), torch.randn(9, 4, generator=gen)]
    plan = plan_buckets([(str(i), v.shape, v.dtype) for i, v in enumerate(values)], 2**16)
    (bucket,) = plan.buckets

    def pack(
        tensors: list[torch.Tensor], pieces: tuple = bucket.pieces
    ) -> tuple[int, torch.Tensor]:
        buffer = torch.full((2**16,), 0xAB, dtype=torch.uint8)
        packer = BucketPacker(buffer)
        with Copies() as copies:
            for piece in pieces:
                packer.add(piece, tensors[piece.tensor_index])
            packer.flush()
        for piece in pieces:
            got = buffer[piece.bucket_offset : piece.bucket_offset + piece.num_bytes]
            assert torch.equal(got, flat_bytes(values[piece.tensor_index]))
        return copies.count, buffer

    laid = device_copies(values, torch.device("cpu"))
    assert pack(laid)[0] == 1
    assert pack(values)[0] == len(values)  # an allocation each
    strided = [*laid[:3], laid[3].t().contiguous().t()]
    assert pack(strided)[0] == 2
    count, buffer = pack(laid, (bucket.pieces[0], bucket.pieces[2]))  # piece 1 not packed here
    assert count == 2 and bool((buffer[bucket.pieces[1].bucket_offset] == 0xAB).all())


def test_empty_stream_has_no_buckets() -> None:
    plan = plan_buckets([], 2**16)
    assert plan.buckets == () and plan.total_bytes == 0


def test_duplicate_names_and_tiny_buckets_are_rejected() -> None:
    with pytest.raises(ValueError, match="repeats tensor names"):
        plan_buckets([("a", (1,), torch.float32), ("a", (2,), torch.float32)], 2**16)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", (1,), torch.float32)], 16)


def test_metadata_accepts_tensor_meta_and_counts_bytes() -> None:
    meta = TensorMeta("x", (2, 3), torch.bfloat16)
    assert meta.num_bytes == 12
    assert plan_buckets([meta], 2**16).total_bytes == 12


def test_plan_key_names_the_tensors_and_nothing_else() -> None:
    """Plans of the same tensors share a key (also in another process: a digest, not
    ``hash()``); a changed name, shape or dtype changes it, the bucket size does not."""
    metas = [("a", (2, 3), torch.bfloat16), ("b", (4,), torch.float32)]
    key = plan_buckets(metas, 2**16).key
    assert key == plan_buckets(metas, 2**10).key
    assert key == plan_buckets([TensorMeta(*m) for m in metas], 2**16).key
    for changed in (
        [("a", (2, 3), torch.bfloat16), ("c", (4,), torch.float32)],
        [("a", (3, 2), torch.bfloat16), ("b", (4,), torch.float32)],
        [("a", (2, 3), torch.float16), ("b", (4,), torch.float32)],
    ):
        assert plan_buckets(changed, 2**16).key != key
    code = (
        "import torch; from tandem.weight_sync.buckets import plan_buckets; "
        f"print(plan_buckets({metas!r}, 256).key)"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == key


def test_in_place_tensors_are_yielded_once_at_their_last_piece() -> None:
    """Tensors the sender shared in place are not read from the buffer; a split one is yielded
    once, in the bucket of its last piece, and nothing is assembled for it."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(100, generator=gen),
        "big": torch.randn(3000, generator=gen),  # 12 KB: split over 3 buckets of 4 KiB
        "c": torch.randn(10, generator=gen),
        "d": torch.randn(200, generator=gen),
    }
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors.items()], 4096)
    shared = {1, 3}  # tensor indices of "big" and "d": read where they live
    values = list(tensors.values())
    yielded: list[tuple[int, str]] = []
    partial: dict[int, torch.Tensor] = {}
    for i, bucket in enumerate(plan.buckets):
        buffer = torch.full((4096,), 0xAB, dtype=torch.uint8)  # in-place pieces stay garbage
        for piece in bucket.pieces:
            if piece.tensor_index not in shared:
                pack_piece(buffer, piece, values[piece.tensor_index])
        for index, tensor in unpack_bucket(buffer, bucket, plan, partial, shared):
            name = plan.tensors[index].name
            yielded.append((i, name))
            if index in shared:
                assert tensor is None  # the receiver reads it where it lives
            else:
                assert tensor is not None and torch.equal(tensor, tensors[name]), name
        assert not partial  # nothing was assembled for the split in-place tensor
    big_buckets = [
        i for i, b in enumerate(plan.buckets) if any(p.tensor_index == 1 for p in b.pieces)
    ]
    assert len(big_buckets) == 3
    assert [name for _, name in yielded] == ["a", "big", "c", "d"]
    assert (big_buckets[-1], "big") in yielded
