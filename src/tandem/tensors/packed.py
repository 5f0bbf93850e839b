"""A weight stream whose tensors lie in one flat tensor.

A LoRA refit sends hundreds of small adapters (392 for rank-32 adapters on a 28-layer model's
seven projections). Copied at once they are a few kernels, but a stream of (name, tensor) pairs
still costs the sender a view per tensor and the receiver a check per tensor that they lie back
to back: milliseconds of host work against ~0.1 ms of copying on a GPU. A ``PackedStream`` is
still such a stream (iterating it yields the views, for any receiver and every transport); a
receiver in the same process whose own tensors lie the same way copies ``flat`` at once
(``target``), its layout compared once per sender's layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from tandem.tensors.copies import span

Layout = tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
"""Per tensor, in stream order: (shape, stride, element offset into the flat tensor)."""


def layout_of(tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> Layout:
    return tuple(
        (tuple(t.shape), tuple(t.stride()), at) for t, at in zip(tensors, offsets, strict=True)
    )


class PackedStream:
    """``names`` in stream order and their tensors as views of ``flat`` laid out by ``layout``
    (the sender keeps one ``Layout`` object while its tensors stay where they are)."""

    def __init__(self, names: list[str], layout: Layout, flat: torch.Tensor) -> None:
        self.names, self.layout, self.flat = names, layout, flat

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, stride, at) in zip(self.names, self.layout, strict=True):
            yield name, self.flat.as_strided(shape, stride, at)

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (the gaps between them not counted)."""
        numel = sum(torch.Size(shape).numel() for shape, _, _ in self.layout)
        return numel * self.flat.element_size()


class PackedTarget:
    """Where a receiver's ``tensors`` (stream order) lie, to take a ``PackedStream`` in one copy
    when they lie as its layout says. Checked once per layout and placement of the tensors."""

    def __init__(self) -> None:
        self._checked: tuple[Layout, list[int], torch.Tensor | None] | None = None

    def target(
        self, names: list[str], tensors: Sequence[torch.Tensor], stream: PackedStream
    ) -> torch.Tensor | None:
        """The flat tensor over ``tensors`` to copy ``stream.flat`` into, or None when they do
        not lie as the stream's tensors do (other names, order, shapes or gaps)."""
        placed = [t.data_ptr() for t in tensors]  # moved (a sleep, an onload): check anew
        checked = self._checked
        if checked is not None and checked[0] is stream.layout and checked[1] == placed:
            return checked[2]
        flat = None
        found = span(tensors) if names == stream.names else None
        if (
            found is not None
            and layout_of(tensors, found[1]) == stream.layout
            and found[0].numel() == stream.flat.numel()
        ):
            flat = found[0]
        self._checked = (stream.layout, placed, flat)
        return flat
