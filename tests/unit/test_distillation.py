"""On-policy distillation's advantage, the judge's verdict parser and the reward section's
checks."""

from __future__ import annotations

import re

import pytest
import torch

from tandem.algorithms.distillation import distill_advantages
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.scorers import TeacherWorker, parse_verdict
from tandem.config import GrpoConfig, load_config
from tandem.config.load import ConfigError
from tandem.data.batch import right_padded


def test_the_advantage_is_the_negative_per_token_reverse_kl() -> None:
    teacher = torch.tensor([[0.0, -1.0, -0.5, -9.0], [0.0, -2.0, -0.1, 0.0]])
    student = torch.tensor([[0.0, -0.5, -0.5, -1.0], [0.0, -1.0, -0.3, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    advantages, metrics = distill_advantages(teacher, student, mask, coef=2.0)
    expected = torch.tensor([[0.0, -1.0, 0.0, 0.0], [0.0, -2.0, 0.4, 0.0]])
    assert torch.allclose(advantages, expected)  # masked tokens (the -9 one) get nothing
    # KL(student || teacher) sampled: mean of student - teacher over the 4 trained tokens
    assert metrics["distill/reverse_kl"] == pytest.approx((0.5 + 0.0 + 1.0 - 0.2) / 4)
    assert metrics["distill/teacher_logprob"] == pytest.approx((-1.0 - 0.5 - 2.0 - 0.1) / 4)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_teacher_gives_the_logprobs_of_its_logits_over_its_temperature(
    temperature: float,
) -> None:
    """``algorithm.teacher_temperature``: each sampled token's logprob under
    ``softmax(logits / temperature)`` of the teacher, as transformers computes the logits."""
    from transformers import AutoModelForCausalLM

    config = load_config(GrpoConfig, None, [f"algorithm.teacher_temperature={temperature}"])
    worker = TeacherWorker(
        config.policy, str(DEFAULT_MODEL_DIR), offload=False, temperature=temperature
    )
    rows = [([49, 55, 43, 50, 53, 61], [52, 50, 256]), ([55, 45, 51, 61], [52, 256])]
    batch = right_padded(rows, pad_token_id=256)
    got = worker.logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR))
    with torch.no_grad():
        logits = model(batch.input_ids).logits[:, :-1] / temperature
    expected = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.attention_mask[:, 1:].bool()
    assert torch.allclose(got[:, 1:][mask], expected[mask], atol=1e-5)
    assert got[:, 1:][mask].mean() != pytest.approx(0.0)


@pytest.mark.parametrize(
    ("text", "pattern", "value"),
    [
        ("Score: 7/10", r"-?\d+(?:\.\d+)?", 7.0),
        ("I give it 8.5 out of 10", r"-?\d+(?:\.\d+)?", 8.5),
        ("no number here", r"-?\d+(?:\.\d+)?", None),
        ("verdict=[[3]] (ten was 10)", r"\[\[(\d+)\]\]", 3.0),
        ("verdict: 3", r"\[\[(\d+)\]\]", None),
    ],
)
def test_verdicts_are_parsed_by_the_pattern(text: str, pattern: str, value: float | None) -> None:
    assert parse_verdict(text, re.compile(pattern)) == value


def test_the_reward_section_is_checked_when_loaded() -> None:
    config = load_config(GrpoConfig, None, ["reward.judge=/some/judge"])
    assert "{response}" in config.reward.judge_template
    assert config.reward.has_models and config.reward.rule_weight == 1.0
    with pytest.raises(ConfigError, match="judge_pattern is not a regular expression"):
        load_config(GrpoConfig, None, ["reward.judge_pattern=(unclosed"])
    with pytest.raises(ConfigError, match=re.escape("lacks {prompt} and {response}")):
        load_config(GrpoConfig, None, ["reward.judge=/j", "reward.judge_template=Grade it:"])
