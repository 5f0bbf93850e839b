"""DPO / IPO: the losses against hand computations, the policy-gradient form against autograd of
the pairwise loss, preference files (and their errors), and a step through the real trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.algorithms.dpo import (
    dpo_step,
    margins,
    pair_losses,
    pair_stats,
    preference_gradient_loss,
    sequence_logprobs,
)
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import TrainerWorker
from tandem.cluster.groups import LocalGroup
from tandem.cluster.runtime import Runtime
from tandem.config import DpoConfig, load_config
from tandem.config.dpo import PreferenceDataConfig
from tandem.config.models import RefitConfig
from tandem.data.batch import TrainBatch
from tandem.data.preferences import load_pairs, load_preference_file, preference_batch
from tandem.data.prompts import PromptSource, load_tokenizer
from tandem.rewards import load_reward


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_margins_and_losses_by_hand() -> None:
    # two pairs: rows (chosen, rejected), (chosen, rejected)
    policy = torch.tensor([-2.0, -3.0, -1.0, -0.5])
    reference = torch.tensor([-2.5, -2.0, -1.0, -1.5])
    # pair 0: (-2 + 2.5) - (-3 + 2) = 0.5 + 1 = 1.5; pair 1: 0 - (1.0) = -1.0
    assert margins(policy, reference).tolist() == pytest.approx([1.5, -1.0])
    m = torch.tensor([1.5, -1.0])
    beta = 0.5
    dpo = [-math.log(_sigmoid(0.75)), -math.log(_sigmoid(-0.5))]
    assert pair_losses(m, beta, "dpo").tolist() == pytest.approx(dpo, rel=1e-6)
    # IPO: (m - 1 / (2 * 0.5))^2 = (m - 1)^2
    assert pair_losses(m, beta, "ipo").tolist() == pytest.approx([0.25, 4.0])
    with pytest.raises(ValueError, match="allowed: dpo, ipo"):
        pair_losses(m, beta, "kto")


def test_pair_weights_are_the_loss_derivative_by_hand() -> None:
    policy = torch.tensor([-2.0, -3.0, -1.0, -0.5])
    reference = torch.tensor([-2.5, -2.0, -1.0, -1.5])
    stats = pair_stats(policy, reference, beta=0.5, kind="dpo")
    # d/dm -log sigmoid(b m) = -b sigmoid(-b m); chosen gets its negative, rejected the value
    d0, d1 = -0.5 * _sigmoid(-0.75), -0.5 * _sigmoid(0.5)
    assert stats.weight.tolist() == pytest.approx([-d0, d0, -d1, d1], rel=1e-6)
    ipo = pair_stats(policy, reference, beta=0.5, kind="ipo")
    # d/dm (m - 1)^2 = 2 (m - 1): 1.0 and -4.0
    assert ipo.weight.tolist() == pytest.approx([-1.0, 1.0, 4.0, -4.0])
    # RPO: + 0.5 * (-log pi(chosen)) per pair: the chosen rows gain weight 0.5
    rpo = pair_stats(policy, reference, beta=0.5, kind="ipo", nll_coef=0.5)
    assert rpo.weight.tolist() == pytest.approx([-0.5, 1.0, 4.5, -4.0])
    assert rpo.loss.tolist() == pytest.approx([0.25 + 1.0, 4.0 + 0.5])
    assert rpo.chosen_logprob.tolist() == [-2.0, -1.0]


@pytest.mark.parametrize(("kind", "nll_coef"), [("dpo", 0.0), ("ipo", 0.0), ("dpo", 0.7)])
def test_policy_gradient_form_has_the_pairwise_gradient(kind: str, nll_coef: float) -> None:
    """Split into two micro-batches that separate every pair, the per-sequence form gives the
    gradient of the pairwise loss computed directly with autograd."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (4, 5))
    mask = torch.tensor(
        [[0, 0, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    ).float()
    reference = torch.randn(4) - 3.0
    beta = 0.3

    def token_logprobs() -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]

    # the pairwise loss, written out: mean over pairs of the loss of the margin
    seq = (token_logprobs() * mask).sum(-1)
    m = (
        (seq[0] - reference[0]) - (seq[1] - reference[1]),
        (seq[2] - reference[2]) - (seq[3] - reference[3]),
    )
    if kind == "dpo":
        direct = sum(-torch.nn.functional.logsigmoid(beta * x) for x in m) / 2
    else:
        direct = sum((x - 1 / (2 * beta)) ** 2 for x in m) / 2
    direct = direct - nll_coef * (seq[0] + seq[2]) / 2
    (expected,) = torch.autograd.grad(direct, logits)

    policy = sequence_logprobs(token_logprobs().detach(), mask)
    stats = pair_stats(policy, reference, beta, kind, nll_coef)
    batch = TrainBatch(
        input_ids=tokens,
        attention_mask=torch.ones_like(tokens),
        loss_mask=mask,
        advantages=stats.weight[:, None] * mask,
    )
    total = torch.zeros(())
    for rows in (torch.tensor([0, 2]), torch.tensor([1, 3])):  # no pair in one micro-batch
        loss, _ = preference_gradient_loss(token_logprobs()[rows], batch.select(rows), 12, 4)
        total = total + loss
    (got,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(got, expected)
    assert float(stats.loss.mean()) == pytest.approx(float(direct.detach()))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(DEFAULT_MODEL_DIR)


def _source(tokenizer: Any, pairs: list[dict[str, str]]) -> PromptSource:
    return PromptSource(pairs, pairs, tokenizer, load_reward("exact_match"), seed=0)


def test_preference_batch_rows_and_masks(tokenizer: Any) -> None:
    source = _source(tokenizer, [{"prompt": "1+1=", "chosen": "2", "rejected": "13"}])
    batch = preference_batch(source, source.train)
    assert batch.num_sequences == 2
    prompt = source.encode("1+1=")
    for row, response in enumerate(["2", "13"]):
        ids = [*source.encode(response), tokenizer.eos_token_id]
        end = len(prompt) + len(ids)
        assert batch.input_ids[row, :end].tolist() == prompt + ids
        assert batch.loss_mask[row].nonzero().flatten().tolist() == list(range(len(prompt), end))


def test_arithmetic_pairs_prefer_the_right_answer() -> None:
    train, held_out, prompts = load_pairs(
        PreferenceDataConfig(num_eval_pairs=16), seed=3, num_train=200
    )
    assert len(train) == 200 and len(held_out) == 16 and len(prompts) == 16
    for pair in train + held_out:
        assert pair["chosen"] != pair["rejected"]
        assert 1 <= abs(int(pair["chosen"]) - int(pair["rejected"])) <= 10
        assert int(pair["rejected"]) >= 0
    assert [p["prompt"] for p in held_out] == [p["prompt"] for p in prompts]
    assert {p["prompt"] for p in held_out}.isdisjoint(p["prompt"] for p in train)


def test_preference_files_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [{"q": "hi", "good": "hello", "bad": "go away"}, {"q": "2+2=", "good": "4", "bad": "5"}]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = PreferenceDataConfig(
        task="file", train_path=jsonl, prompt_key="q", chosen_key="good", rejected_key="bad"
    )
    expected = [{"prompt": r["q"], "chosen": r["good"], "rejected": r["bad"]} for r in rows]
    assert load_preference_file(jsonl, config) == expected
    import datasets

    parquet = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert load_preference_file(parquet, config) == expected
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([rows[0], {**rows[1], "bad": ""}]).to_parquet(str(bad))
    with pytest.raises(ValueError, match=r"bad\.parquet: row 2: 'bad' must be a non-empty string"):
        load_preference_file(bad, config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a"\n',
            r"pairs\.jsonl:2: not valid JSON",
        ),
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n',
            r"pairs\.jsonl:2: missing key\(s\) \['rejected'\]",
        ),
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
            '{"prompt": "a", "chosen": "", "rejected": "c"}\n',
            r"pairs\.jsonl:2: 'chosen' must be a non-empty string",
        ),
    ],
)
def test_a_bad_row_names_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_preference_file(path, PreferenceDataConfig(task="file", train_path=path))


def test_cli_names_a_missing_preference_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.cli import main

    missing = tmp_path / "none.jsonl"
    args = ["dpo", "data.task=file", f"data.train_path={missing}", f"logging.run_dir={tmp_path}"]
    assert main(args) == 2
    assert f"data.train_path: data file not found: {missing}" in capsys.readouterr().err


def test_dpo_step_trains_through_the_trainer(tmp_path: Path, tokenizer: Any) -> None:
    """Two steps on the same pairs through the real trainer worker: the first sees margin 0
    (policy = reference), the second a positive margin on the pairs it was trained on."""
    config = load_config(
        DpoConfig,
        "dpo_arithmetic",
        ["policy.optimizer.lr=3e-3", "algorithm.batch_size=8", "algorithm.nll_coef=0"],
    )
    algo = config.algorithm
    trainer = TrainerWorker(
        policy=config.policy,
        refit=RefitConfig(),
        generation=config.generation,
        with_reference=True,
        total_steps=2,
    )
    train, _, _ = load_pairs(config.data, seed=0, num_train=8)
    source = PromptSource(train * 2, [], tokenizer, load_reward("exact_match"), seed=0)
    runtime = Runtime(LocalGroup([trainer], "trainer"), None, with_reference=True)
    with runtime:
        first = dpo_step(runtime, source, 1, algo)
        # same pairs again: train_prompts of step 1 covers the second copy of the same 8
        source.train = train
        second = dpo_step(runtime, source, 1, algo)
    assert first["train/margin"] == 0.0 and first["train/preference_accuracy"] == 0.0
    assert first["train/loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert second["train/margin"] > 0 and second["train/preference_accuracy"] > 0.5
    assert second["train/loss"] < math.log(2)
