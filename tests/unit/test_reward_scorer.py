"""The reward scorer: results checked to be finite numbers, a raising reward reported once with
the user's traceback, a hanging reward cut off per sample in a worker process."""

from __future__ import annotations

import math
import time

import pytest

from tandem.rewards import RewardError, RewardScorer

HERE = __name__
SAMPLES = [("1+1=", "2", "2"), ("2+2=", "nan", "4"), ("3+3=", "6", "6")]


def by_response(prompt: str, response: str, answer: str) -> object:
    """1.0 / 0.0 by exact match; the responses 'nan', 'text', 'raise' and 'hang' misbehave."""
    if response == "nan":
        return math.nan
    if response == "text":
        return "1.0"
    if response == "raise":
        return {}["no such key"]  # a KeyError from the user's own line
    if response == "hang":
        time.sleep(600)
    return 1.0 if response == answer else 0.0


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(("response", "shown"), [("nan", "returned nan"), ("text", "str '1.0'")])
def test_an_invalid_reward_is_an_error_naming_the_sample(
    workers: int, response: str, shown: str
) -> None:
    scorer = RewardScorer(f"{HERE}:by_response", num_workers=workers)
    with scorer, pytest.raises(RewardError) as info:
        scorer.score([("1+1=", "2", "2"), ("2+2=", response, "4")])
    message = str(info.value)
    assert shown in message and "not a finite number" in message
    assert f"prompt='2+2=', response='{response}'" in message
    assert "data.invalid_reward=zero" in message


def test_invalid_rewards_score_zero_and_are_counted_when_asked() -> None:
    samples = [*SAMPLES, ("4+4=", "text", "8")]
    with RewardScorer(f"{HERE}:by_response", num_workers=2, invalid="zero") as scorer:
        scores = scorer.score(samples)
    assert scores.rewards == [1.0, 0.0, 1.0, 0.0]
    assert scores.metrics["reward/invalid_count"] == 2
    assert scores.metrics["reward/timeout_count"] == 0


@pytest.mark.parametrize("workers", [0, 1])
def test_a_raising_reward_shows_the_users_traceback_once(workers: int) -> None:
    scorer = RewardScorer(f"{HERE}:by_response", num_workers=workers)
    with scorer, pytest.raises(RewardError) as info:
        scorer.score([("1+1=", "raise", "2")])
    message = str(info.value)
    assert message.count("Traceback") == 1
    assert 'return {}["no such key"]' in message and "KeyError" in message
    assert "response='raise'" in message


def test_a_hanging_reward_is_cut_off_and_the_rest_still_scored() -> None:
    samples = [("1+1=", "2", "2"), ("h", "hang", "0"), ("3+3=", "6", "6"), ("4+4=", "7", "8")]
    with RewardScorer(
        f"{HERE}:by_response", num_workers=2, timeout_s=2.0, invalid="zero"
    ) as scorer:
        start = time.perf_counter()
        scores = scorer.score(samples)
        elapsed = time.perf_counter() - start
        assert scores.rewards == [1.0, 0.0, 1.0, 0.0]
        assert scores.metrics["reward/timeout_count"] == 1
        assert elapsed < 60  # cut off, not the 600 s the reward would sleep
        # the pool came back: the next batch is scored normally
        assert scorer.score(SAMPLES[:1]).rewards == [1.0]


def test_a_hanging_reward_is_an_error_by_default() -> None:
    scorer = RewardScorer(f"{HERE}:by_response", num_workers=1, timeout_s=1.0)
    with scorer, pytest.raises(RewardError, match=r"took longer than data.reward_timeout_s=1 s"):
        scorer.score([("h", "hang", "0")])


def test_a_reward_that_cannot_hang_is_scored_without_workers() -> None:
    with RewardScorer("exact_match", num_workers=2) as scorer:
        scores = scorer.score([("1+1=", "2", "2"), ("2+2=", "5", "4")])
        assert scores.rewards == [1.0, 0.0]
        assert scorer._workers == []  # no worker processes started
    with RewardScorer(f"{HERE}:by_response", num_workers=1) as scorer:
        assert scorer.score([("1+1=", "2", "2")]).rewards == [1.0]
        assert scorer._workers  # a user's reward may hang: it gets its workers
