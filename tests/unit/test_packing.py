"""Micro-batches without compute on padding or repeated prompts (``data.packing``): layouts by
hand, and the packed, budgeted and shared-prompt paths giving the padded path's loss and gradients
(fp32, 1e-6) on a real model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_support import make_batch, policy, token_nll, write_tiny_qwen2

from tandem.data import packing
from tandem.data.batch import TrainBatch
from tandem.data.packing import (
    layout_cost,
    pack_sequences,
    plan_micro_batches,
    prompt_segments,
    unpack,
)
from tandem.trainer import PolicyTrainer
from tandem.trainer.policy_trainer import shared_prompt_cost


def batch_of(lengths: list[int], width: int = 6) -> TrainBatch:
    ids = (
        torch.arange(1, width + 1).repeat(len(lengths), 1)
        + 10 * torch.arange(len(lengths))[:, None]
    )
    attention = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return TrainBatch(ids * attention, attention, attention.float())


def test_sequences_pack_longest_first_into_rows_as_long_as_the_longest() -> None:
    packed = pack_sequences(batch_of([2, 5, 3]))
    # rows of 5: [seq1 (5)], [seq2 (3) | seq0 (2)]
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 1, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packed.attention_mask is None  # transformers derives it from the positions
    # the flat index (row x 5 + column) of the token that predicts token t of each sequence
    assert packed.sources.tolist() == [
        [0, 8, 0, 0, 0, 0],
        [0, 0, 1, 2, 3, 0],
        [0, 5, 6, 0, 0, 0],
    ]
    # one output per valid entry (1 <= t < length), row-major, back in the [b, T] layout
    assert unpack(torch.tensor([1.0, 2, 3, 4, 5, 6, 7]), packed).tolist() == [
        [0, 1, 0, 0, 0, 0],
        [0, 2, 3, 4, 5, 0],
        [0, 6, 7, 0, 0, 0],
    ]


def grouped_batch(prompts: list[list[int]], own: list[list[list[int]]]) -> TrainBatch:
    """Sequences ``prompt + own`` right-padded, the loss on the own tokens."""
    rows = [(p, o) for p, group in zip(prompts, own, strict=True) for o in group]
    width = max(len(p) + len(o) for p, o in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    loss = torch.zeros(len(rows), width)
    for j, (p, o) in enumerate(rows):
        ids[j, : len(p) + len(o)] = torch.tensor(p + o)
        loss[j, len(p) : len(p) + len(o)] = 1
    return TrainBatch(ids, (ids > 0).long(), loss)


def test_a_shared_prompt_is_laid_out_once_and_seen_by_each_sequence() -> None:
    # two sequences of prompt [1, 2, 3], one of prompt [7, 8]
    batch = grouped_batch([[1, 2, 3], [7, 8]], [[[4, 5], [6]], [[9]]])
    packed = pack_sequences(batch, prompt_segments(batch))
    # segments of 3 + 2 + 1 = 6 and 2 + 1 = 3 tokens, in rows of 6
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3]  # 6 is token 3 of its sequence
    assert packed.position_ids[1, :3].tolist() == [0, 1, 2]
    # token 3 of sequence 1 (the 6) is predicted by the prompt's last token (flat 2)
    assert packed.sources.tolist() == [[0, 0, 1, 2, 3], [0, 0, 1, 2, 0], [0, 6, 7, 0, 0]]
    assert packed.attention_mask is not None
    row = packed.attention_mask[0, 0].int().tolist()
    assert row == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # 4: the prompt and itself
        [1, 1, 1, 1, 1, 0],  # 5: the prompt, 4 and itself
        [1, 1, 1, 0, 0, 1],  # 6: the prompt and itself, not the other sequence
    ]
    padding = packed.attention_mask[1, 0].int().tolist()
    assert padding[3:] == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]


def test_prompts_are_shared_where_the_estimate_says_it_is_cheaper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 4 sequences of a 6-token prompt and 2 own tokens: padded 4 x (8 + 0.05 x 36) = 39.2,
    # shared one row of 6 + 4 x 2 = 14 under a dense mask: 14 + 0.05 x 196 = 23.8
    short = grouped_batch([[1, 2, 3, 4, 5, 6]], [[[7, 8], [8, 7], [9, 9], [7, 7]]])
    assert layout_cost(4, 8, False, 0.05) == pytest.approx(39.2)
    assert layout_cost(1, 14, True, 0.05) == pytest.approx(23.8)
    # a 2-token prompt and 37 own tokens: padded 4 x (39 + 0.05 x 780) = 312, shared
    # 150 + 0.05 x 150^2 = 1275
    long = grouped_batch([[1, 2]], [[[3 + k] * 37 for k in range(4)]])
    for batch, shared in ((short, True), (long, False)):
        (mb,) = plan_micro_batches(batch, max_sequences=8, attention_cost=0.05)
        assert (mb.packed is not None) is shared
    # packed sequences compare with their own dense rows: 4 rows of 8 (4 x 11.2 = 44.8)
    (mb,) = plan_micro_batches(short, max_sequences=8, pack=True, attention_cost=0.05)
    assert mb.packed is not None and mb.packed.attention_mask is not None
    # without an attention cost nothing is shared
    (mb,) = plan_micro_batches(short, max_sequences=8)
    assert mb.packed is None
    # nor where the mask would be too large (one row of 14: 196 entries)
    monkeypatch.setattr(packing, "MAX_MASK_ENTRIES", 195)
    (mb,) = plan_micro_batches(short, max_sequences=8, attention_cost=0.05)
    assert mb.packed is None


def rows_and_widths(plan: list[packing.MicroBatch]) -> list[tuple[list[int], int]]:
    return [(mb.rows.tolist(), mb.batch.input_ids.shape[1]) for mb in plan]


def test_micro_batches_keep_an_image_s_rows_together_where_the_tower_costs_more() -> None:
    """Rows 0-1 share one image, rows 2-3 another (a GRPO group's samples): sorted by length
    ([6, 5] and [2, 1]) each micro-batch holds both images, so the tower runs 4 times instead
    of 2; the padding saved (22 -> 16 tokens) is worth it only while patches are cheap."""
    from tandem.data.images import ImageInputs, RowImages

    def image() -> ImageInputs:  # 16 patches
        return ImageInputs(torch.zeros(16, 8), torch.tensor([[1, 4, 4]]))

    first, second = image(), image()
    plain = batch_of([6, 1, 5, 2])
    batch = TrainBatch(
        plain.input_ids,
        plain.attention_mask,
        plain.loss_mask,
        images=RowImages.from_rows([first, first, second, second]),
    )
    assert packing.image_patches(batch, torch.tensor([0, 1, 2])) == 32  # each image once
    sorted_plan = [([0, 2], 6), ([1, 3], 2)]
    for patch_cost in (0.0, 0.1):  # padding 16 + 64 x 0.1 < 22 + 32 x 0.1
        plan = plan_micro_batches(batch, 2, overhead=10**6, patch_cost=patch_cost)
        assert rows_and_widths(plan) == sorted_plan
    grouped = plan_micro_batches(batch, 2, overhead=10**6, patch_cost=1.0)
    assert rows_and_widths(grouped) == [([0, 1], 6), ([2, 3], 5)]
    assert [len({id(r) for r in mb.batch.images.rows}) for mb in grouped] == [1, 1]


def test_micro_batches_hold_similar_lengths_where_a_cut_saves_more_than_it_costs() -> None:
    batch = batch_of([6, 1, 5, 2, 2])
    # in order: [6, 1], [5, 2], [2] = 12 + 10 + 2 padded tokens; sorted: [6, 5], [2, 2], [1]
    # = 12 + 4 + 1 for the same three micro-batches
    plain = plan_micro_batches(batch, max_sequences=2, overhead=10**6)
    assert rows_and_widths(plain) == [([0, 2], 6), ([3, 4], 2), ([1], 1)]  # trimmed
    # free micro-batches: a cut at every change of length
    cut = plan_micro_batches(batch, max_sequences=8, overhead=0)
    assert rows_and_widths(cut) == [([0], 6), ([2], 5), ([3, 4], 2), ([1], 1)]
    # 4 x 10 and 4 x 2 tokens: one micro-batch pads 32 tokens, so a cut is worth overhead < 32
    two = batch_of([10, 2, 10, 2, 2, 10, 10, 2], width=10)
    assert len(plan_micro_batches(two, max_sequences=8, overhead=31)) == 2
    assert rows_and_widths(plan_micro_batches(two, max_sequences=8, overhead=33)) == [
        (list(range(8)), 10)
    ]
    # lengths within 1/256 of the longest of each other are one run: no cut between 1022 and
    # 1021 (it would save 1 token), one before 10
    near = batch_of([1022, 10, 1021], width=1022)
    assert rows_and_widths(plan_micro_batches(near, max_sequences=8, overhead=0)) == [
        ([0, 2], 1022),
        ([1], 10),
    ]
    # a padded budget, count x longest <= 10: [6], [5], [2, 2, 1] pads 1 token, where the
    # equally many [6], [5, 2], [2, 1] would pad 4
    budget = plan_micro_batches(batch, max_sequences=4, max_tokens=10)
    assert rows_and_widths(budget) == [([0], 6), ([2], 5), ([1, 3, 4], 2)]
    two_budget = plan_micro_batches(two, max_sequences=8, max_tokens=20, overhead=10**6)
    assert rows_and_widths(two_budget) == [([0, 2], 10), ([5, 6], 10), ([1, 3, 4, 7], 2)]
    # packed cost = real tokens: 6 + 5 > 8, 5 + 2 <= 8, 5 + 2 + 2 > 8, then 2 + 1
    packed = plan_micro_batches(batch, max_sequences=4, max_tokens=8, pack=True)
    assert [mb.rows.tolist() for mb in packed] == [[0], [2, 3], [1, 4]]
    assert [tuple(mb.packed.input_ids.shape) for mb in packed if mb.packed] == [
        (1, 6),
        (2, 5),  # 5 and 2 do not share a row of 5
        (2, 2),  # nor 2 and 1 a row of 2
    ]
    covered = sorted(r for mb in packed for r in mb.rows.tolist())
    assert covered == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny"), tied=True)


def loss_and_grads(
    trainer: PolicyTrainer, batch: TrainBatch
) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """The training forward and backward of every micro-batch, without the optimizer step."""
    trainer.model.zero_grad(set_to_none=True)
    num_tokens = float(batch.loss_mask.sum())
    total = 0.0
    for mb, _ in trainer._micro_batches(batch):
        logprobs, _ = trainer._forward(trainer._on_device(mb), with_entropy=False)
        loss, _ = token_nll(logprobs, mb.batch, num_tokens, float(batch.num_sequences))
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return total, grads, trainer.logprobs(batch)


def assert_same_step(padded: PolicyTrainer, other: PolicyTrainer, batch: TrainBatch) -> None:
    """``other``'s layouts give ``padded``'s loss, gradients and logprobs (fp32, 1e-6), and 0
    on padding."""
    loss_a, grads_a, logprobs_a = loss_and_grads(padded, batch)
    loss_b, grads_b, logprobs_b = loss_and_grads(other, batch)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert torch.allclose(grads_b[name], grad, atol=1e-6, rtol=0), name
    assert torch.allclose(logprobs_b, logprobs_a, atol=1e-6, rtol=0)
    assert (logprobs_b[batch.attention_mask == 0] == 0).all()


@pytest.mark.parametrize(
    "setup",
    [
        {"packing": True},
        {"max_tokens_per_micro_batch": 30},
        {"packing": True, "micro_batch_size": 8},
        {"micro_batch_overhead": 0},
    ],
    ids=["packed", "token-budget", "packed-one-micro-batch", "cut-by-length"],
)
def test_packed_and_budgeted_paths_give_the_padded_loss_and_gradients(
    model_dir: Path, setup: dict
) -> None:
    batch = make_batch(size=7, width=12)
    # one padded micro-batch: no cut is worth its cost
    padded = PolicyTrainer(policy(model_dir, micro_batch_size=8, micro_batch_overhead=10**6))
    assert len(padded._micro_batches(batch)) == 1
    other = PolicyTrainer(policy(model_dir, **{"micro_batch_size": 3, **setup}))
    if "micro_batch_overhead" in setup:  # free micro-batches: cut at every change of length
        lengths = batch.attention_mask.sum(-1).unique()
        assert len(other._micro_batches(batch)) >= len(lengths) > 1
    assert_same_step(padded, other, batch)


def shared_batch() -> TrainBatch:
    """``make_batch``'s rows, 6-token prompts: two groups of three sharing one, one alone."""
    batch = make_batch(size=7, width=12)
    batch.input_ids[:, :6] = batch.input_ids[[0, 0, 0, 3, 3, 3, 6], :6]
    batch.loss_mask[:, :6] = 0
    return batch


@pytest.mark.parametrize(
    "setup",
    [{}, {"packing": True}, {"micro_batch_size": 4}],
    ids=["shared", "shared-packed", "shared-across-micro-batches"],
)
def test_shared_prompts_give_the_padded_loss_and_gradients(model_dir: Path, setup: dict) -> None:
    batch = shared_batch()
    padded = PolicyTrainer(policy(model_dir, micro_batch_size=7, share_prompts=False))
    shared = PolicyTrainer(policy(model_dir, **{"micro_batch_size": 7, **setup}))
    layouts = [mb.packed for mb, _ in shared._micro_batches(batch)]
    assert all(p is not None and p.attention_mask is not None for p in layouts)
    assert sum(p.input_ids.numel() for p in layouts if p is not None) < batch.input_ids.numel()
    assert_same_step(padded, shared, batch)


def test_the_attention_cost_of_a_model_and_where_there_is_none(tmp_path: Path) -> None:
    import transformers

    lm = transformers.AutoModelForCausalLM.from_pretrained(
        write_tiny_qwen2(tmp_path / "full", tied=True)
    )
    # 2 layers x 4 heads x 32 against the layers' weights: 2 x 2 x 128 / weights
    weights = sum(p.numel() for p in lm.model.layers.parameters()) + lm.model.norm.weight.numel()
    assert shared_prompt_cost(lm) == pytest.approx(2 * 2 * 128 / weights)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
    )
    windowed = transformers.Qwen2ForCausalLM(config)
    assert "sliding_attention" in windowed.config.layer_types
    assert shared_prompt_cost(windowed) is None  # a custom mask would drop the windows
    lm.config._attn_implementation = "flash_attention_2"
    assert shared_prompt_cost(lm) is None
