"""Bucket planning, packing and unpacking for refit.

A bucket is a flat ``uint8`` buffer of ``bucket_bytes``. Tensors are laid out in the order of the
weight stream, each at an offset aligned to ``ALIGN_BYTES`` and reinterpreted with
``.view(dtype)``, so any dtype (bf16, float8, int64, 0-dim scalars) travels bit-exact.

Buckets hold bytes, not one dtype: a weight stream with interleaved dtypes (FP8 weights followed
by their fp32 scales) would otherwise need one open buffer per dtype on top of the two that
alternate. A tensor larger than ``bucket_bytes`` is split across consecutive buckets (byte
ranges of its flat storage); the receiver assembles it into a tensor of its own.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from tandem.tensors.copies import ALIGN_BYTES


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor of the weight stream."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """Bytes ``[tensor_start, tensor_start + num_bytes)`` of tensor ``tensor_index``, stored at
    ``bucket_offset`` of its bucket. A tensor that fits a bucket is one piece."""

    tensor_index: int
    tensor_start: int
    num_bytes: int
    bucket_offset: int
    tensor_bytes: int

    @property
    def is_whole(self) -> bool:
        return self.num_bytes == self.tensor_bytes

    @property
    def is_last(self) -> bool:
        """Whether this piece completes its tensor."""
        return self.tensor_start + self.num_bytes == self.tensor_bytes


@dataclass(frozen=True)
class Bucket:
    """The pieces of one bucket and the bytes it uses (what goes over the wire)."""

    pieces: tuple[Piece, ...]
    used_bytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Where every tensor of a weight stream goes; computed once per metadata, sent in the spec."""

    tensors: tuple[TensorMeta, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    key: str = ""
    """A digest of ``tensors`` (names, shapes, dtypes): a receiver that checked its targets
    against one plan knows, from the key alone, that they fit the next plan with that key."""

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Bytes of every tensor, in stream order."""
        return tuple(meta.num_bytes for meta in self.tensors)

    @property
    def total_bytes(self) -> int:
        """Payload bytes of the stream (without alignment padding)."""
        return sum(self.sizes)


def _align(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def as_metadata(entries: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> list[TensorMeta]:
    """Normalise ``(name, shape, dtype)`` triples (or ``TensorMeta``) to ``TensorMeta``."""
    metas: list[TensorMeta] = []
    for entry in entries:
        if isinstance(entry, TensorMeta):
            metas.append(entry)
            continue
        name, shape, dtype = entry
        metas.append(TensorMeta(name, tuple(int(s) for s in shape), dtype))
    return metas


def plan_buckets(
    metadata: Iterable[tuple[str, Sequence[int], torch.dtype]] | Iterable[TensorMeta],
    bucket_bytes: int,
) -> BucketPlan:
    """Assign the tensors of a weight stream, in stream order, to buckets of ``bucket_bytes``.

    A tensor starts a new bucket when it does not fit the rest of the current one; a tensor
    larger than a whole bucket is split into bucket-sized pieces (at element boundaries).
    """
    if bucket_bytes < ALIGN_BYTES:
        raise ValueError(f"refit.bucket_bytes={bucket_bytes} is too small; use >= {ALIGN_BYTES}")
    metas = tuple(as_metadata(metadata))  # type: ignore[arg-type]
    names = [meta.name for meta in metas]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"weight metadata repeats tensor names {duplicates}; names must be unique")
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    offset = 0

    def close() -> None:
        nonlocal pieces, offset
        if pieces:
            buckets.append(Bucket(tuple(pieces), offset))
        pieces, offset = [], 0

    for index, meta in enumerate(metas):
        size = meta.num_bytes
        if size <= bucket_bytes:
            if _align(offset) + size > bucket_bytes:
                close()
            start = _align(offset)
            pieces.append(Piece(index, 0, size, start, size))
            offset = start + size
            continue
        # Too large for one bucket: whole buckets of it, element-aligned, from a fresh bucket.
        close()
        chunk = bucket_bytes // meta.dtype.itemsize * meta.dtype.itemsize
        for tensor_start in range(0, size, chunk):
            num_bytes = min(chunk, size - tensor_start)
            pieces.append(Piece(index, tensor_start, num_bytes, 0, size))
            offset = num_bytes
            if num_bytes == chunk:
                close()
    close()
    key = hashlib.blake2b(repr(metas).encode(), digest_size=16).hexdigest()
    return BucketPlan(metas, tuple(buckets), bucket_bytes, key)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` as a 1-D uint8 view (0-dim tensors included)."""
    tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def pack_piece(buffer: torch.Tensor, piece: Piece, tensor: torch.Tensor) -> None:
    """Copy the bytes of ``piece`` from ``tensor`` into the uint8 ``buffer``."""
    src = flat_bytes(tensor)[piece.tensor_start : piece.tensor_start + piece.num_bytes]
    dst = buffer[piece.bucket_offset : piece.bucket_offset + piece.num_bytes]
    dst.copy_(src, non_blocking=True)


class BucketPacker:
    """Packs a bucket's pieces into its buffer, a run of them in one copy: pieces that follow
    each other in the bucket (only its padding between them) and whose bytes lie the same
    distances apart in one storage (a stream of views of one buffer laid out like a bucket:
    ``trainer.lora.Adapters.scaled_copy``) are one range of bytes, the padding copied with them.
    The open run holds its first tensor, which shares the storage of the others: no more memory
    stays alive than ``pack_piece`` one at a time keeps. A run is copied when a piece does not
    continue it, so a stream must not write over a tensor it yielded while it yields the next
    ones (none of tandem's streams does). ``flush()`` after the last piece."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._run: tuple[torch.Tensor, int, int, int, int] | None = None
        """The open run: its first tensor, its source address, its start and end in the bucket,
        the end of its source storage."""

    def add(self, piece: Piece, tensor: torch.Tensor) -> None:
        """``piece`` of ``tensor``: into the open run when it continues it, else the open run
        is copied and ``piece`` opens the next."""
        if not piece.num_bytes:
            return
        if not tensor.is_contiguous():  # a copy of its own (made contiguous on the way)
            self.flush()
            pack_piece(self.buffer, piece, tensor)
            return
        src = tensor.data_ptr() + piece.tensor_start
        end = piece.bucket_offset + piece.num_bytes
        if self._run is not None:
            first, src_start, start, run_end, limit = self._run
            follows = run_end <= piece.bucket_offset < run_end + ALIGN_BYTES
            if (
                follows
                and src - src_start == piece.bucket_offset - start
                and src + piece.num_bytes <= limit
            ):
                self._run = (first, src_start, start, end, limit)
                return
            self.flush()
        storage = tensor.untyped_storage()
        self._run = (tensor, src, piece.bucket_offset, end, storage.data_ptr() + storage.nbytes())

    def flush(self) -> None:
        """Copy the open run."""
        if self._run is None:
            return
        first, src_start, start, end, _ = self._run
        storage = first.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=first.device)
        raw.set_(storage, src_start - storage.data_ptr(), (end - start,), (1,))
        self.buffer[start:end].copy_(raw, non_blocking=True)
        self._run = None


def piece_view(buffer: torch.Tensor, piece: Piece, meta: TensorMeta) -> torch.Tensor:
    """A view of a whole tensor stored in ``buffer`` (no copy)."""
    raw = buffer[piece.bucket_offset : piece.bucket_offset + piece.num_bytes]
    return raw.view(meta.dtype).view(meta.shape)


def unpack_bucket(
    buffer: torch.Tensor,
    bucket: Bucket,
    plan: BucketPlan,
    partial: dict[int, torch.Tensor],
    in_place: Container[int] = (),
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Yield ``(tensor index, tensor)`` for the tensors a bucket completes: views for whole
    tensors, assembled tensors (owned) for split ones. ``partial`` carries split tensors from one
    bucket to the next. ``in_place``: indices of tensors the sender did not pack (read where they
    live); each is yielded with its last piece, as ``None``."""
    for piece in bucket.pieces:
        index = piece.tensor_index
        meta = plan.tensors[index]
        if index in in_place:
            if piece.is_last:
                yield index, None
            continue
        if piece.is_whole:
            yield index, piece_view(buffer, piece, meta)
            continue
        if index not in partial:
            partial[index] = torch.empty(meta.shape, dtype=meta.dtype, device=buffer.device)
        target = partial[index]
        src = buffer[piece.bucket_offset : piece.bucket_offset + piece.num_bytes]
        flat_bytes(target)[piece.tensor_start : piece.tensor_start + piece.num_bytes].copy_(src)
        if piece.is_last:
            yield index, partial.pop(index)


def check_target(meta: TensorMeta, target: torch.Tensor) -> torch.Tensor:
    """``target`` if it can receive tensor ``meta`` of a refit, else ValueError naming both."""
    if target.dtype != meta.dtype or target.shape != meta.shape:
        raise ValueError(
            f"refit target of {meta.name!r} is {tuple(target.shape)} {target.dtype} but the "
            f"weight stream has {meta.shape} {meta.dtype}"
        )
    return target


def check_tensor(meta: TensorMeta, name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError when a streamed tensor differs from the metadata given to prepare()."""
    if name != meta.name or tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
        raise ValueError(
            f"weight stream yielded {name!r} {tuple(tensor.shape)} {tensor.dtype} where the "
            f"metadata given to prepare() expects {meta.name!r} {meta.shape} {meta.dtype}; "
            "stream the tensors in the order and shapes of the metadata"
        )
