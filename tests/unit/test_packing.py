"""Micro-batches without compute on padding (``data.packing``): layouts by hand, and the packed
and budgeted paths giving the padded path's loss and gradients (fp32, 1e-6) on a real model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_support import make_batch, policy, token_nll, write_tiny_qwen2

from tandem.data.batch import TrainBatch
from tandem.data.packing import pack_sequences, plan_micro_batches, unpack
from tandem.trainer import PolicyTrainer


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
    values = torch.arange(10.0).view(2, 5)  # token-aligned outputs of the packed rows
    # each sequence's entries 1..length-1 come back; entry 0 (predicted by the row's previous
    # sequence, or nothing) and the padding are 0
    assert unpack(values, packed).tolist() == [
        [0, 9, 0, 0, 0, 0],
        [0, 1, 2, 3, 4, 0],
        [0, 6, 7, 0, 0, 0],
    ]


def test_budgets_group_by_length_and_trim() -> None:
    batch = batch_of([6, 1, 5, 2, 2])
    plain = plan_micro_batches(batch, max_sequences=2)
    assert [mb.rows.tolist() for mb in plain] == [[0, 1], [2, 3], [4]]
    assert [mb.batch.input_ids.shape[1] for mb in plain] == [6, 5, 2]  # trimmed
    # longest first; padded cost = count x longest: 2 x 6 > 10, 2 x 5 <= 10, 3 x 5 > 10
    budget = plan_micro_batches(batch, max_sequences=4, max_tokens=10)
    assert [mb.rows.tolist() for mb in budget] == [[0], [2, 3], [1, 4]]
    assert [mb.batch.input_ids.shape[1] for mb in budget] == [6, 5, 2]
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
        logprobs, _ = trainer._forward(mb, with_entropy=False)
        loss, _ = token_nll(logprobs, mb.batch, num_tokens, float(batch.num_sequences))
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return total, grads, trainer.logprobs(batch)


@pytest.mark.parametrize(
    "setup",
    [
        {"packing": True},
        {"max_tokens_per_micro_batch": 30},
        {"packing": True, "micro_batch_size": 8},
    ],
    ids=["packed", "token-budget", "packed-one-micro-batch"],
)
def test_packed_and_budgeted_paths_give_the_padded_loss_and_gradients(
    model_dir: Path, setup: dict
) -> None:
    batch = make_batch(size=7, width=12)
    padded = PolicyTrainer(policy(model_dir, micro_batch_size=3))
    other = PolicyTrainer(policy(model_dir, **{"micro_batch_size": 3, **setup}))
    loss_a, grads_a, logprobs_a = loss_and_grads(padded, batch)
    loss_b, grads_b, logprobs_b = loss_and_grads(other, batch)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert torch.allclose(grads_b[name], grad, atol=1e-6, rtol=0), name
    assert torch.allclose(logprobs_b, logprobs_a, atol=1e-6, rtol=0)
    assert (logprobs_a[batch.attention_mask == 0] == 0).all()
