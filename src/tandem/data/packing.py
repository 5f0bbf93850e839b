"""Micro-batches without compute on padding or repeated prompts: token budgets, trimming,
sequence packing and shared prompts.

A right-padded ``TrainBatch`` is cut into micro-batches for the trainer's forward passes:

- every micro-batch is trimmed to its own longest sequence (right padding after it is never
  attended to, so this changes nothing but the work);
- unpacked, the sequences are sorted by length and cut into runs where the padding a cut
  saves outweighs a micro-batch's fixed cost (``overhead``, in tokens of compute: its kernel
  launches and Python); a run longer than ``max_sequences``, or whose padded size passes
  ``max_tokens``, is split into consecutive micro-batches. The plan is compared with the
  micro-batches of ``max_sequences`` in order, and the cheaper one by ``layout_cost`` (with
  shared prompts where they apply) is taken: sorting scatters GRPO's groups, whose shared prompt
  can be worth more than the padding;
- packed, with ``max_tokens``, the sequences are grouped longest first so that a micro-batch's
  real tokens stay within that budget, however long they are;
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

from collections.abc import Iterable
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


MICRO_BATCH_OVERHEAD = {"cpu": 128, "cuda": 4096}
"""A micro-batch's fixed cost in tokens of compute, by device type (``policy.
micro_batch_overhead`` overrides), measured on a 2-core CPU by splitting the same tokens into
more micro-batches (60-160 tokens' worth; figures: docs/benchmarks/2026-12-05-cpu-e2e-amd.md).
A GPU runs a token in microseconds and a micro-batch's kernel launches in milliseconds."""


def plan_micro_batches(
    batch: TrainBatch,
    max_sequences: int,
    max_tokens: int | None = None,
    pack: bool = False,
    attention_cost: float | None = None,
    overhead: int = MICRO_BATCH_OVERHEAD["cpu"],
    patch_cost: float = 0.0,
) -> list[MicroBatch]:
    """Micro-batches covering every sequence of ``batch`` once (see the module docstring).

    Unpacked: the cheaper of the sorted runs (``_cut_by_length``) and groups of
    ``max_sequences`` in order (when ``max_tokens`` allows them), by ``layout_cost`` plus
    ``overhead`` per micro-batch. Packed: sequences go longest first into groups of at most
    ``max_sequences`` whose real tokens stay within ``max_tokens`` (default ``max_sequences`` x
    the longest sequence); a sequence longer than the budget gets a micro-batch of its own.
    With ``attention_cost`` (see ``layout_cost``) a micro-batch whose sequences share prompts
    computes each once where that is cheaper. ``patch_cost``: what one image patch costs
    through the vision tower, in tokens of the language model; a micro-batch runs the tower
    once per distinct image it holds (a GRPO group's samples share theirs), so sorting by
    length, which scatters the groups, weighs the images it repeats."""
    if not batch.num_sequences:
        return []
    lengths = sequence_lengths(batch)
    prompts = _Prompts(batch) if attention_cost is not None else None
    if pack:
        budget = max_tokens or max_sequences * int(lengths.max())
        groups = _budget_groups(lengths, max_sequences, budget)
        return [
            _micro_batch(*_layout(batch, rows, True, attention_cost, prompts)) for rows in groups
        ]
    plans = [_cut_by_length(lengths, max_sequences, max_tokens, overhead)]
    in_order = _in_order(lengths.tolist(), max_sequences, max_tokens)
    if [g.tolist() for g in plans[0]] != [g.tolist() for g in in_order]:
        plans.append(in_order)
    laid = [
        [_layout(batch, rows, False, attention_cost, prompts) for rows in groups]
        for groups in plans
    ]
    images = [
        sum(image_patches(batch, rows) for rows in groups) * patch_cost if patch_cost else 0.0
        for groups in plans
    ]
    cheapest = min(
        range(len(laid)),
        key=lambda k: sum(cost for *_, cost in laid[k]) + overhead * len(laid[k]) + images[k],
    )
    return [_micro_batch(*parts) for parts in laid[cheapest]]


def _in_order(lengths: list[int], max_sequences: int, max_tokens: int | None) -> list[torch.Tensor]:
    """Consecutive sequences (a GRPO group's samples stay together), a micro-batch closing
    where one more would pass ``max_sequences`` or ``max_tokens`` padded."""
    groups: list[list[int]] = []
    longest = 0
    for row, length in enumerate(lengths):
        widest = max(longest, length)
        full = groups and len(groups[-1]) >= max_sequences
        over = groups and max_tokens is not None and (len(groups[-1]) + 1) * widest > max_tokens
        if not groups or full or over:
            groups.append([row])
            longest = length
        else:
            groups[-1].append(row)
            longest = widest
    return [torch.tensor(g) for g in groups]


def image_patches(batch: TrainBatch, rows: torch.Tensor) -> int:
    """The patches the vision tower runs for a micro-batch of ``rows``: each distinct image
    once (0 for text)."""
    if batch.images is None:
        return 0
    images = batch.images
    used = {images.index[int(i)] for i in rows.tolist()} - {-1}
    return sum(int(images.distinct[d].image_grid_thw.prod(-1).sum()) for d in used)


def _layout(
    batch: TrainBatch,
    rows: torch.Tensor,
    pack: bool,
    attention_cost: float | None,
    prompts: _Prompts | None,
) -> tuple[torch.Tensor, TrainBatch, Packed | None, list[Segment] | None, float]:
    """The micro-batch of ``rows`` in its cheaper layout, built lazily where prompts are
    shared: (rows, its trimmed sequences, its packed layout, the segments that share prompts
    instead (None: not shared), the layout's cost)."""
    part = trimmed(batch.select(rows))
    packed = pack_sequences(part) if pack else None
    rows_, width = (part if packed is None else packed).input_ids.shape
    cost = layout_cost(rows_, width, pack, attention_cost or 0.0)
    if attention_cost is not None and prompts is not None:
        segments = _segments(prompts, rows.tolist())
        shared = _shared_cost(part, segments, attention_cost)
        if shared is not None and shared < cost:
            return rows, part, None, segments, shared
    return rows, part, packed, None, cost


def _micro_batch(
    rows: torch.Tensor,
    part: TrainBatch,
    packed: Packed | None,
    segments: list[Segment] | None,
    _: float,
) -> MicroBatch:
    if segments is not None:
        packed = pack_sequences(part, segments)
    return MicroBatch(rows, part, packed)


CUT_RESOLUTION = 256
"""``_cut_by_length`` weighs cuts between lengths that differ by 1/256 of the longest, so its
dynamic program has at most 257 runs, however many sequences and lengths (with every distinct
length a run it took seconds for 4096 sequences; figures:
docs/benchmarks/2026-12-05-cpu-e2e-amd.md)."""


def _cut_by_length(
    lengths: torch.Tensor, max_sequences: int, max_tokens: int | None, overhead: int
) -> list[torch.Tensor]:
    """Sequences sorted longest first, cut where a cut saves more padded tokens than
    ``overhead``: dynamic programming over runs of (nearly, ``CUT_RESOLUTION``) equal length.
    A run of more than ``max_sequences``, or ``max_tokens`` padded, becomes consecutive
    micro-batches within those bounds (padded to at most its longest)."""
    order = torch.argsort(lengths, descending=True, stable=True)
    sizes = lengths[order].tolist()
    n = len(sizes)
    unit = max(1, sizes[0] // CUT_RESOLUTION)
    bounds = [0] + [i for i in range(1, n) if sizes[i] // unit != sizes[i - 1] // unit] + [n]
    tokens = [0]  # tokens[k]: real tokens of the k longest sequences
    for size in sizes:
        tokens.append(tokens[-1] + size)
    # sequences a micro-batch starting at bounds[a] holds
    fits = [
        max(1, min(max_sequences, max_tokens // max(sizes[i], 1) if max_tokens is not None else n))
        for i in bounds[:-1]
    ]
    # best[b]: least cost of the sequences before bounds[b]; start[b]: where its last cut is
    best, start = [0.0] * len(bounds), [0] * len(bounds)
    for b in range(1, len(bounds)):
        j = bounds[b]
        best[b] = float("inf")
        for a in range(b - 1, -1, -1):  # the last micro-batch starts at bounds[a]
            i = bounds[a]
            padding = (j - i) * sizes[i] - (tokens[j] - tokens[i])
            if tokens[j] + padding >= best[b]:
                break  # padding only grows with an earlier start; every cost >= tokens[j]
            cost = best[a] + (j - i) * sizes[i] + overhead * -(-(j - i) // fits[a])
            if cost < best[b]:
                best[b], start[b] = cost, a
    groups: list[torch.Tensor] = []
    b = len(bounds) - 1
    while b:
        a = start[b]
        i, j = bounds[a], bounds[b]
        groups[:0] = [order[k : min(k + fits[a], j)].sort().values for k in range(i, j, fits[a])]
        b = a
    return groups


MAX_MASK_ENTRIES = 2**28
"""The largest ``[R, 1, C, C]`` mask a shared-prompt layout may take (256 MiB of bools; SDPA
may turn it into the model's dtype): beyond it a micro-batch keeps its own layout."""


def _shared_cost(part: TrainBatch, segments: list[Segment], attention_cost: float) -> float | None:
    """``layout_cost`` of ``segments`` laid out with shared prompts; None where no prompt is
    shared or the mask would pass ``MAX_MASK_ENTRIES``."""
    if len(segments) == part.num_sequences:
        return None
    count, capacity, _ = _place([s.size for s in segments])
    if count * capacity * capacity > MAX_MASK_ENTRIES:
        return None
    return layout_cost(count, capacity, True, attention_cost)


def layout_cost(rows: int, width: int, dense: bool, attention_cost: float) -> float:
    """Estimated forward cost of ``rows`` x ``width`` tokens, in units of one token through the
    model's linear layers: each token, plus ``attention_cost`` for each (query, key) pair
    attention computes: all ``width`` keys of a row under an explicit mask (``dense``), half of
    them under the causal kernel."""
    pairs = width * width if dense else width * (width + 1) / 2
    return rows * (width + attention_cost * pairs)


def _budget_groups(lengths: torch.Tensor, max_sequences: int, budget: int) -> list[torch.Tensor]:
    """Longest first into groups of at most ``max_sequences`` and ``budget`` real tokens."""
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    groups: list[list[int]] = []
    cost = 0
    for row in order:
        length = int(lengths[row])
        if not groups or len(groups[-1]) >= max_sequences or cost + length > budget:
            groups.append([row])
            cost = length
        else:
            groups[-1].append(row)
            cost += length
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
    return _segments(_Prompts(batch), range(batch.num_sequences))


class _Prompts:
    """Each sequence's prompt (see ``prompt_segments``) as an id shared by equal prompts, its
    prompt's length and its own length; found once for a batch, used by its micro-batches."""

    def __init__(self, batch: TrainBatch) -> None:
        self.lengths = sequence_lengths(batch).tolist()
        trained = batch.loss_mask > 0
        first = torch.where(
            trained.any(-1), trained.int().argmax(-1), batch.attention_mask.sum(-1)
        ).tolist()
        self.prompt = [
            min(start, length) for start, length in zip(first, self.lengths, strict=True)
        ]
        ids = batch.input_ids.tolist()
        keys: dict[tuple[int, ...], int] = {}
        self.key = [
            keys.setdefault(tuple(ids[j][: self.prompt[j]]), len(keys)) for j in range(len(ids))
        ]


def _segments(prompts: _Prompts, rows: Iterable[int]) -> list[Segment]:
    """``prompt_segments`` of the micro-batch of ``rows`` (members are its own indices)."""
    by_key: dict[int, Segment] = {}
    for j, row in enumerate(rows):
        segment = by_key.get(prompts.key[row])
        if segment is None:
            segment = by_key[prompts.key[row]] = Segment([], prompts.prompt[row], [])
        segment.members.append(j)
        segment.lengths.append(prompts.lengths[row])
    return list(by_key.values())


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
