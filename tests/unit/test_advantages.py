"""Advantage estimators against values worked out by hand on 2-3 groups of 3 samples."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algorithms.advantages import AdvantageEstimator, compute_advantages, token_advantages

# Two groups of 3: [1, 0, 0] and [0, 1, 2].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 2.0])
SQRT3 = math.sqrt(3.0)


def test_grpo_uses_unbiased_group_std() -> None:
    # [1, 0, 0]: mean 1/3, deviations (2/3, -1/3, -1/3), unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3,
    #   std 1/sqrt(3) -> (2/sqrt(3), -1/sqrt(3), -1/sqrt(3)) = (1.1547, -0.57735, -0.57735).
    #   (The biased std sqrt(2/9) would give (1.4142, -0.7071, -0.7071).)
    # [0, 1, 2]: mean 1, deviations (-1, 0, 1), unbiased var 2 / 2 = 1 -> (-1, 0, 1).
    result = compute_advantages(REWARDS, num_generations=3, estimator="grpo")
    expected = torch.tensor([2 / SQRT3, -1 / SQRT3, -1 / SQRT3, -1.0, 0.0, 1.0])
    torch.testing.assert_close(result.advantages, expected, atol=1e-5, rtol=0)


def test_dr_grpo_is_mean_only() -> None:
    # Deviations from the group mean, no std: (2/3, -1/3, -1/3) and (-1, 0, 1).
    result = compute_advantages(REWARDS, num_generations=3, estimator="dr_grpo")
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 0.0, 1.0])
    torch.testing.assert_close(result.advantages, expected)


def test_rloo_leaves_one_out() -> None:
    # [1, 0, 0]: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice).
    # [0, 1, 2]: 0 - mean(1, 2) = -1.5; 1 - mean(0, 2) = 0; 2 - mean(0, 1) = 1.5.
    result = compute_advantages(REWARDS, num_generations=3, estimator="rloo")
    expected = torch.tensor([1.0, -0.5, -0.5, -1.5, 0.0, 1.5])
    torch.testing.assert_close(result.advantages, expected)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_zero_variance_groups_are_zeroed_counted_and_masked(estimator: AdvantageEstimator) -> None:
    # Middle group [0.1, 0.1, 0.1] is constant; its float32 mean is not exactly 0.1, so without
    # the explicit zeroing GRPO would divide a rounding residue by eps.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 1.0, 2.0])
    result = compute_advantages(rewards, num_generations=3, estimator=estimator)
    assert result.advantages[3:6].tolist() == [0.0, 0.0, 0.0]
    assert result.keep_mask.tolist() == [True] * 3 + [False] * 3 + [True] * 3
    assert result.metrics["num_groups"] == 3
    assert result.metrics["num_zero_variance_groups"] == 1
    assert result.metrics["zero_variance_group_frac"] == pytest.approx(1 / 3)
    # The other groups are unaffected by their neighbour.
    alone = compute_advantages(REWARDS, num_generations=3, estimator=estimator).advantages
    torch.testing.assert_close(result.advantages[[0, 1, 2, 6, 7, 8]], alone)


def test_all_groups_varied_keeps_everything() -> None:
    result = compute_advantages(REWARDS, num_generations=3)
    assert result.keep_mask.all()
    assert result.metrics["num_zero_variance_groups"] == 0
    assert result.metrics["zero_variance_group_frac"] == 0.0


def test_invalid_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="num_generations"):
        compute_advantages(torch.tensor([1.0, 0.0]), num_generations=1)
    with pytest.raises(ValueError, match="num_prompts \\* num_generations"):
        compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=3)
    with pytest.raises(ValueError, match="one of"):
        compute_advantages(REWARDS, num_generations=3, estimator="ppo")  # type: ignore[arg-type]


def test_token_advantages_broadcast_over_loss_mask() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    out = token_advantages(torch.tensor([2.0, -1.0]), loss_mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, -1.0]]
    with pytest.raises(ValueError, match="advantages must be"):
        token_advantages(torch.tensor([2.0, -1.0, 0.5]), loss_mask)


def test_reinforce_pp_returns_by_hand() -> None:
    """Rewards (1, 0); masks: row 0 trains tokens 1-3, row 1 tokens 2-3; kl per token 0.5
    everywhere, kl_coef 0.2 -> token reward -0.1 on each trained token, the sequence reward on
    the last. Returns to go: row 0 (1 - 0.3, 1 - 0.2, 1 - 0.1) = (0.7, 0.8, 0.9); row 1
    (-0.2, -0.1)."""
    from tandem.algorithms.advantages import reinforce_pp_returns

    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.float32)
    kl = torch.full((2, 4), 0.5)
    returns = reinforce_pp_returns(torch.tensor([1.0, 0.0]), mask, kl, kl_coef=0.2)
    expected = torch.tensor([[0, 0.7, 0.8, 0.9], [0, 0, -0.2, -0.1]])
    torch.testing.assert_close(returns, expected)
    plain = reinforce_pp_returns(torch.tensor([1.0, 0.0]), mask)  # no KL: the reward everywhere
    torch.testing.assert_close(plain, torch.tensor([[0, 1, 1, 1], [0, 0, 0, 0.0]]))


def test_batch_normalise_over_trained_tokens_only() -> None:
    from tandem.algorithms.advantages import batch_normalise

    values = torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    # trained values 1, 2, 3: mean 2, unbiased std 1
    out = batch_normalise(values, mask)
    torch.testing.assert_close(
        out, torch.tensor([[0.0, -1.0, 0.0], [0.0, 1.0, 0.0]]), atol=1e-6, rtol=0
    )


def test_reinforce_pp_keeps_equal_groups_and_baseline_centres_them() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # group 0 all equal
    plain = compute_advantages(rewards, 2, "reinforce_pp")
    torch.testing.assert_close(plain.advantages, rewards)  # raw rewards; shaped per token later
    baseline = compute_advantages(rewards, 2, "reinforce_pp_baseline")
    torch.testing.assert_close(baseline.advantages, torch.tensor([0.0, 0.0, -0.5, 0.5]))


def test_overlong_penalty_is_linear_in_the_buffer() -> None:
    from tandem.algorithms.advantages import overlong_penalty

    lengths = torch.tensor([10, 12, 14, 16])  # max 16, buffer 4: 0 up to 12, then -> 1 at 16
    torch.testing.assert_close(
        overlong_penalty(lengths, 16, 4, 0.5), torch.tensor([0.0, 0.0, 0.25, 0.5])
    )
