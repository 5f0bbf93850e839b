"""Micro-batches without compute on padding or repeated prompts: token budgets, trimming,
sequence packing and shared prompts.

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
  the tail of a row is padding;
- with ``attention_cost`` the sequences of a micro-batch that share a prompt (the tokens before
  their first trained token: GRPO's groups, DPO's pairs) are laid out as one *segment*: the
  prompt once, then each sequence's own tokens, at the positions they have in the sequence,
  attending to the prompt and causally to themselves (an explicit ``[R, 1, C, C]`` mask). The
  prompt's tokens are computed once instead of once per sequence; the hidden state of its last
  token predicts every sequence's first own token. A micro-batch takes this layout only when it
  is estimated cheaper than its own (``layout_cost``): the mask is dense, so long completions
  make attention cost more than the prompt tokens save.

``Packed.sources`` maps each token back to the hidden state that predicts it, so the losses read
``[b, T]`` logprobs as from the padded layout. Any grouping gives the full-batch step: losses are
normalised by global token counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.data.batch import TrainBatch


@dataclass(frozen=True)
class Packed:
    """Sequences (or shared-prompt segments) laid end to end in ``[R, C]`` rows."""

    input_ids: torch.Tensor
    """[R, C] token ids; a row's tail is padding."""
    position_ids: torch.Tensor
    """[R, C] each token's position in its own sequence."""
    sources: torch.Tensor
    """[b, T] flat index into ``[R * C]`` of the token whose hidden state predicts token t of
    sequence j (its token t - 1; 0 where not ``valid``)."""
    valid: torch.Tensor
    """[b, T] bool: 1 <= t < length of sequence j (entry 0 is predicted by nothing)."""
    attention_mask: torch.Tensor | None = None
    """[R, 1, C, C] bool (True: attends) when prompts are shared; None: block-diagonal causal
    from the restarting ``position_ids``."""


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
    batch: TrainBatch,
    max_sequences: int,
    max_tokens: int | None = None,
    pack: bool = False,
    attention_cost: float | None = None,
) -> list[MicroBatch]:
    """Micro-batches covering every sequence of ``batch`` once (see the module docstring).

    Without ``max_tokens`` or ``pack``: consecutive groups of ``max_sequences``, trimmed.
    Otherwise sequences go longest first into groups of at most ``max_sequences`` whose cost
    stays within ``max_tokens`` (default ``max_sequences`` x the longest sequence): the padded
    size ``count x longest`` unpacked, the real tokens packed. A sequence longer than the
    budget gets a micro-batch of its own. With ``attention_cost`` (see ``layout_cost``) a
    micro-batch whose sequences share prompts computes each once where that is cheaper."""
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
        layout = pack_sequences(part) if pack else None
        if attention_cost is not None:
            segments = prompt_segments(part)
            if _sharing_is_cheaper(part, layout, segments, attention_cost):
                layout = pack_sequences(part, segments)
        micro.append(MicroBatch(rows, part, layout))
    return micro


MAX_MASK_ENTRIES = 2**28
"""The largest ``[R, 1, C, C]`` mask a shared-prompt layout may take (256 MiB of bools; SDPA
may turn it into the model's dtype): beyond it a micro-batch keeps its own layout."""


def _sharing_is_cheaper(
    part: TrainBatch, layout: Packed | None, segments: list[Segment], attention_cost: float
) -> bool:
    """Whether ``segments`` share a prompt and laying them out costs less than ``layout``
    (packed) or ``part``'s padded rows (None), with a mask of at most ``MAX_MASK_ENTRIES``."""
    if len(segments) == part.num_sequences:
        return False
    count, capacity, _ = _place([s.size for s in segments])
    if count * capacity * capacity > MAX_MASK_ENTRIES:
        return False
    rows, width = (part if layout is None else layout).input_ids.shape
    own = layout_cost(rows, width, layout is not None, attention_cost)
    return layout_cost(count, capacity, True, attention_cost) < own


def layout_cost(rows: int, width: int, dense: bool, attention_cost: float) -> float:
    """Estimated forward cost of ``rows`` x ``width`` tokens, in units of one token through the
    model's linear layers: each token, plus ``attention_cost`` for each (query, key) pair
    attention computes: all ``width`` keys of a row under an explicit mask (``dense``), half of
    them under the causal kernel."""
    pairs = width * width if dense else width * (width + 1) / 2
    return rows * (width + attention_cost * pairs)


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


@dataclass(frozen=True)
class Segment:
    """Sequences laid out together: a prompt of ``prompt`` tokens that all of them start with,
    computed once, then each one's own tokens."""

    members: list[int]
    prompt: int
    lengths: list[int]

    @property
    def size(self) -> int:
        return self.prompt + sum(length - self.prompt for length in self.lengths)


def prompt_segments(batch: TrainBatch) -> list[Segment]:
    """The sequences of ``batch`` grouped by their prompt: the tokens before the first trained
    one (all of a sequence's tokens when none is trained), in order of first appearance."""
    lengths = sequence_lengths(batch).tolist()
    trained = batch.loss_mask > 0
    first = torch.where(trained.any(-1), trained.int().argmax(-1), batch.attention_mask.sum(-1))
    ids = batch.input_ids.tolist()
    by_prompt: dict[tuple[int, ...], Segment] = {}
    for j, (length, start) in enumerate(zip(lengths, first.tolist(), strict=True)):
        prompt = min(start, length)
        segment = by_prompt.setdefault(tuple(ids[j][:prompt]), Segment([], prompt, []))
        segment.members.append(j)
        segment.lengths.append(length)
    return list(by_prompt.values())


def _place(sizes: list[int]) -> tuple[int, int, list[tuple[int, int]]]:
    """First fit, largest first, into rows as long as the largest item: the number of rows,
    their length and each item's (row, start)."""
    capacity = max(max(sizes), 1)
    free: list[int] = []  # room left in each row
    place: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        row = next((r for r, room in enumerate(free) if room >= sizes[j]), len(free))
        if row == len(free):
            free.append(capacity)
        place[j] = (row, capacity - free[row])
        free[row] -= sizes[j]
    return len(free), capacity, place


def pack_sequences(batch: TrainBatch, segments: list[Segment] | None = None) -> Packed:
    """Lay ``batch``'s sequences end to end in rows as long as its longest (first fit,
    longest first); with ``segments`` (``prompt_segments``), those, in rows as long as the
    longest segment, with their attention mask."""
    lengths = sequence_lengths(batch).tolist()
    shared = segments is not None
    if segments is None:
        segments = [Segment([j], length, [length]) for j, length in enumerate(lengths)]
    count, capacity, place = _place([s.size for s in segments])
    # per sequence: its row, its segment, where the segment's prompt starts and how long it is,
    # and where the sequence's own tokens start; per row, how much of it is used
    size, width = batch.input_ids.shape
    row_of, segment_of, prompt_at, prompt_len, own_at = ([0] * size for _ in range(5))
    used = [0] * count
    for s, (segment, (row, start)) in enumerate(zip(segments, place, strict=True)):
        offset = start + segment.prompt
        for j, length in zip(segment.members, segment.lengths, strict=True):
            row_of[j], segment_of[j], prompt_at[j] = row, s, start
            prompt_len[j], own_at[j] = segment.prompt, offset
            offset += length - segment.prompt
        used[row] = max(used[row], offset)
    t = torch.arange(width)[None]
    prompt = torch.tensor(prompt_len)[:, None]
    column = torch.where(
        t < prompt, torch.tensor(prompt_at)[:, None] + t, torch.tensor(own_at)[:, None] + t - prompt
    )
    flat = torch.tensor(row_of)[:, None] * capacity + column  # [b, T]: where token t is
    real = t < torch.tensor(lengths)[:, None]
    where = flat[real]  # a shared prompt's tokens are written once per sequence, all the same
    input_ids = torch.zeros(count * capacity, dtype=batch.input_ids.dtype)
    input_ids[where] = batch.input_ids[real]
    # a row's padding tail counts from 0: transformers gives it its own block
    columns, ends = torch.arange(capacity)[None], torch.tensor(used)[:, None]
    positions = torch.where(columns >= ends, columns - ends, columns).reshape(-1)
    positions[where] = t.expand(size, width)[real]
    valid = real & (t >= 1)
    sources = torch.zeros((size, width), dtype=torch.long)
    sources[:, 1:] = flat[:, :-1]
    sources = torch.where(valid, sources, 0)
    mask = None
    if shared:
        # a token sees earlier tokens of its segment's prompt and of its own sequence
        seg = torch.full((count * capacity,), -1)
        seg[where] = torch.tensor(segment_of)[:, None].expand(size, width)[real]
        own = real & (t >= prompt)
        sequence = torch.full((count * capacity,), -1)
        sequence[flat[own]] = torch.arange(size)[:, None].expand(size, width)[own]
        seg, sequence = seg.view(count, capacity), sequence.view(count, capacity)
        same = seg[:, :, None] == seg[:, None, :]
        seen = (sequence[:, None, :] == -1) | (sequence[:, :, None] == sequence[:, None, :])
        causal = torch.ones(capacity, capacity, dtype=torch.bool).tril()
        padding = (seg == -1)[:, :, None] & torch.eye(capacity, dtype=torch.bool)
        mask = ((same & seen & (seg[:, :, None] >= 0) & causal) | padding)[:, None]
    return Packed(
        input_ids.view(count, capacity),
        positions.view(count, capacity),
        sources,
        valid,
        mask,
    )


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """``[n]`` per-token outputs of a packed forward, one per ``valid`` entry in row-major
    order (see ``LogprobModel``'s ``sources``), as ``[b, T]`` (0 elsewhere); differentiable."""
    out = values.new_zeros(packed.valid.shape)
    return out.masked_scatter(packed.valid.to(values.device), values)
