"""Micro-batches without compute on padding: token budgets, trimming and sequence packing.

A right-padded ``TrainBatch`` is cut into micro-batches for the trainer's forward passes:

- every micro-batch is trimmed to its own longest sequence (right padding after it is never
  attended to, so this changes nothing but the work);
- with ``max_tokens`` the sequences are sorted by length and grouped so that a micro-batch's
  padded size (or, packed, its real tokens) stays within that budget, however long they are;
- with ``pack`` the sequences of a micro-batch are laid end to end in rows as long as its
  longest sequence (first fit, longest first), with positions restarting at every sequence.
  The model is then called with those ``position_ids`` and no attention mask: transformers
  builds a block-diagonal causal mask from positions that restart (``find_packed_sequence_
  indices``; varlen kernels with FlashAttention), so no token attends across sequences and only
  the tail of a row is padding. ``unpack`` maps per-token outputs back to the ``[b, T]`` layout
  the losses read.

Any grouping gives the full-batch step: losses are normalised by global token counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.data.batch import TrainBatch


@dataclass(frozen=True)
class Packed:
    """Sequences laid end to end in ``[R, C]`` rows."""

    input_ids: torch.Tensor
    """[R, C] token ids; a row's tail is padding (its own segment, positions from 0)."""
    position_ids: torch.Tensor
    """[R, C] positions restarting at 0 for every sequence."""
    index: torch.Tensor
    """[b, T] flat index into ``[R * C]`` of token t of sequence j (0 where t >= its length)."""
    valid: torch.Tensor
    """[b, T] bool: 1 <= t < length of sequence j (entry 0 is predicted by nothing)."""


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor
    """Indices of its sequences in the full batch."""
    batch: TrainBatch
    """Those sequences, trimmed to the longest of them."""
    packed: Packed | None = None


def sequence_lengths(batch: TrainBatch) -> torch.Tensor:
    """Tokens of each right-padded sequence (its attention mask's sum)."""
    return batch.attention_mask.sum(-1)


def trimmed(batch: TrainBatch) -> TrainBatch:
    """``batch`` without the padding columns that no sequence of it reaches."""
    width = max(int(sequence_lengths(batch).max()), 1) if batch.num_sequences else 1
    return batch.columns(slice(0, width))


def plan_micro_batches(
    batch: TrainBatch, max_sequences: int, max_tokens: int | None = None, pack: bool = False
) -> list[MicroBatch]:
    """Micro-batches covering every sequence of ``batch`` once (see the module docstring).

    Without ``max_tokens`` or ``pack``: consecutive groups of ``max_sequences``, trimmed.
    Otherwise sequences go longest first into groups of at most ``max_sequences`` whose cost
    stays within ``max_tokens`` (default ``max_sequences`` x the longest sequence): the padded
    size ``count x longest`` unpacked, the real tokens packed. A sequence longer than the
    budget gets a micro-batch of its own."""
    lengths = sequence_lengths(batch)
    if max_tokens is None and not pack:
        groups = [
            torch.arange(start, min(start + max_sequences, batch.num_sequences))
            for start in range(0, batch.num_sequences, max_sequences)
        ]
    else:
        budget = max_tokens or max_sequences * int(lengths.max())
        groups = _budget_groups(lengths, max_sequences, budget, pack)
    micro = []
    for rows in groups:
        part = trimmed(batch.select(rows))
        micro.append(MicroBatch(rows, part, pack_sequences(part) if pack else None))
    return micro


def _budget_groups(
    lengths: torch.Tensor, max_sequences: int, budget: int, pack: bool
) -> list[torch.Tensor]:
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    groups: list[list[int]] = []
    cost = 0
    for row in order:
        length = int(lengths[row])
        group = groups[-1] if groups else None
        # sorted longest first: the group's first sequence is its longest
        added = length if pack else (0 if group is None else int(lengths[group[0]]))
        if group is None or len(group) >= max_sequences or cost + added > budget:
            groups.append([row])
            cost = length
        else:
            group.append(row)
            cost += added
    return [torch.tensor(sorted(g)) for g in groups]


def pack_sequences(batch: TrainBatch) -> Packed:
    """Lay ``batch``'s sequences end to end in rows as long as its longest (first fit,
    longest first)."""
    lengths = sequence_lengths(batch).tolist()
    capacity = max(max(lengths), 1)
    free: list[int] = []  # room left in each row
    place: dict[int, tuple[int, int]] = {}  # sequence -> (row, start)
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        row = next((r for r, room in enumerate(free) if room >= lengths[j]), len(free))
        if row == len(free):
            free.append(capacity)
        place[j] = (row, capacity - free[row])
        free[row] -= lengths[j]
    input_ids = torch.zeros((len(free), capacity), dtype=batch.input_ids.dtype)
    positions = torch.arange(capacity).repeat(len(free), 1)  # the padding tails count from 0
    width = batch.input_ids.shape[1]
    index = torch.zeros((len(lengths), width), dtype=torch.long)
    steps = torch.arange(width)
    for j, (row, start) in place.items():
        length = lengths[j]
        input_ids[row, start : start + length] = batch.input_ids[j, :length]
        positions[row, start : start + length] = torch.arange(length)
        positions[row, start + length :] = torch.arange(capacity - start - length)
        index[j, :length] = row * capacity + start + steps[:length]
    valid = (steps[None] >= 1) & (steps[None] < torch.tensor(lengths)[:, None])
    return Packed(input_ids, positions, index, valid)


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Token-aligned ``[R, C]`` outputs of a packed forward as ``[b, T]`` (0 at entry 0 and
    beyond each sequence); differentiable."""
    flat = values.reshape(-1)[packed.index.to(values.device)]
    return torch.where(packed.valid.to(values.device), flat, 0.0)
