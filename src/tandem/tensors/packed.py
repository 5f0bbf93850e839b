"""A weight stream whose tensors lie in one flat tensor.

A LoRA refit sends hundreds of small adapters (392 for rank-32 adapters on a 28-layer model's
seven projections). Copied at once they are a few kernels, but a stream of (name, tensor) pairs
still costs the sender a view per tensor and the receiver a check per tensor that they lie back
to back: milliseconds of host work against ~0.1 ms of copying on a GPU. A ``PackedStream`` is
still such a stream (iterating it yields the views, for any receiver and every transport); a
receiver in the same process whose own tensors lie the same way has it written into them at
once (``PackedTarget.target``, then ``write_into``: the sender's kernels write straight into the
receiver's memory, no tensor in between), its layout compared once per sender's layout.

Offload and onload move a storage's bytes (new addresses) but not how tensors lie in it:
``Placement`` tells such a move from a new layout with one address per tensor, so neither side
works a layout out again after every onload or generator wake.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from tandem.tensors.copies import span

Layout = tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
"""Per tensor, in stream order: (shape, stride, element offset into the flat tensor)."""


def layout_of(tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> Layout:
    return tuple(
        (tuple(t.shape), tuple(t.stride()), at) for t, at in zip(tensors, offsets, strict=True)
    )


class Placement:
    """Where tensors lay (their addresses) when a layout was worked out for them. ``same``
    tells whether they still lie so relative to each other inside the first one's storage (a
    storage offloaded and onloaded, or tensors laid out again the same way), so that the
    layout still holds. One ``data_ptr`` per tensor."""

    def __init__(self) -> None:
        self.places: list[int] = []

    def same(self, tensors: Sequence[torch.Tensor]) -> tuple[bool, bool]:
        """(unmoved, moved alike): whether every tensor lies where it lay, and whether they
        all moved by one offset within the first one's storage. Records where they lie now."""
        places = [t.data_ptr() for t in tensors]
        old, self.places = self.places, places
        if places == old:
            return True, True
        if not places or len(places) != len(old):
            return False, False
        shift = places[0] - old[0]
        storage = tensors[0].untyped_storage()
        end = places[-1] + tensors[-1].nbytes
        inside = storage.data_ptr() <= places[0] and end <= storage.data_ptr() + storage.nbytes()
        return False, inside and all(p - o == shift for p, o in zip(places, old, strict=True))


class PackedStream:
    """``names`` in stream order and their tensors as views of one flat tensor of ``numel``
    elements of ``dtype`` on ``device``, laid out by ``layout`` (the sender keeps one ``Layout``
    object while its tensors stay laid out alike). ``write(out)`` fills such a flat tensor:
    ``flat`` is made by it on first use, ``write_into`` writes a receiver's memory directly."""

    def __init__(
        self,
        names: list[str],
        layout: Layout,
        write: Callable[[torch.Tensor], object],
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.names, self.layout, self.numel = names, layout, numel
        self.dtype, self.device = dtype, device
        self._write = write
        self._flat: torch.Tensor | None = None

    @classmethod
    def of(cls, names: list[str], layout: Layout, flat: torch.Tensor) -> PackedStream:
        """A stream over an existing flat tensor."""
        stream = cls(
            names, layout, lambda out: out.copy_(flat), flat.numel(), flat.dtype, flat.device
        )
        stream._flat = flat
        return stream

    @property
    def flat(self) -> torch.Tensor:
        if self._flat is None:
            out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self._write(out)
            self._flat = out
        return self._flat

    def write_into(self, out: torch.Tensor) -> None:
        """Fill ``out`` (``numel`` elements of ``dtype``) with the stream's flat tensor."""
        if self._flat is not None:
            out.copy_(self._flat)
        else:
            self._write(out)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        flat = self.flat
        for name, (shape, stride, at) in zip(self.names, self.layout, strict=True):
            yield name, flat.as_strided(shape, stride, at)

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (the gaps between them not counted)."""
        numel = sum(torch.Size(shape).numel() for shape, _, _ in self.layout)
        return numel * self.dtype.itemsize


class PackedTarget:
    """Where a receiver's ``tensors`` (stream order) lie, to take a ``PackedStream`` in one copy
    when they lie as its layout says. Checked once per layout and placement of the tensors
    (a move of their storage that keeps how they lie in it is no new placement)."""

    def __init__(self) -> None:
        self._checked: tuple[Layout, torch.Tensor | None] | None = None
        self._placement = Placement()

    def target(
        self, names: list[str], tensors: Sequence[torch.Tensor], stream: PackedStream
    ) -> torch.Tensor | None:
        """The flat tensor over ``tensors`` to write the stream into, or None when they do not
        lie as the stream's tensors do (other names, order, shapes or gaps)."""
        unmoved, alike = self._placement.same(tensors)
        checked = self._checked
        if checked is not None and checked[0] is stream.layout and alike:
            flat = checked[1]
            if flat is not None and not unmoved:  # the same layout, its storage moved
                first = tensors[0]
                flat = torch.empty(0, dtype=flat.dtype, device=first.device).set_(
                    first.untyped_storage(), first.storage_offset(), (flat.numel(),), (1,)
                )
                self._checked = (stream.layout, flat)
            return flat
        flat = None
        found = span(tensors) if names == stream.names else None
        if (
            found is not None
            and layout_of(tensors, found[1]) == stream.layout
            and found[0].numel() == stream.numel
        ):
            flat = found[0]
        self._checked = (stream.layout, flat)
        return flat
