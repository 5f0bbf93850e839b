"""Group-relative advantages: each prompt's responses are scored against each other.

Rewards arrive flat, ``[num_prompts * num_generations]``, with the ``num_generations`` responses
of one prompt next to each other. Each estimator maps the ``[num_prompts, num_generations]`` view
to advantages of the same shape:

- ``grpo``: ``(r - group mean) / (group std + eps)``, with the *unbiased* (Bessel-corrected,
  ``n - 1``) std, as in the GRPO paper's reference implementation and TRL.
- ``dr_grpo``: ``r - group mean`` (Dr. GRPO drops the std division, which up-weights groups that
  are nearly solved or nearly failed).
- ``rloo``: ``r_i - mean_{j != i} r_j``, the leave-one-out baseline (= ``n / (n - 1)`` times the
  mean-centred reward).
- ``reinforce_pp`` (REINFORCE++, Hu et al. 2025): no group baseline; the reward, less
  ``kl_coef`` times the per-token KL to the reference as a token-level reward, summed to go
  (gamma = 1), then normalised over every trained token of the batch (``reinforce_pp_returns``,
  ``batch_normalise``). Every group keeps its advantages (there is no group to be degenerate).
- ``reinforce_pp_baseline``: ``r - group mean``, then normalised over every trained token of the
  batch (the KL stays a loss term).

A group whose rewards are all equal carries no learning signal: its advantages are exactly 0 (not
a rounding residue divided by ``eps``), it is counted in the metrics, and ``keep_mask`` marks the
samples of the *other* groups so that the caller can drop it (DAPO's dynamic sampling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]

BATCH_NORMALISED = ("reinforce_pp", "reinforce_pp_baseline")
"""Estimators whose token advantages are normalised over the batch (``batch_normalise``)."""

GRPO_STD_EPS = 1e-6
"""Added to the group std so a near-constant group does not divide by ~0."""


def grpo_advantages(groups: torch.Tensor, eps: float = GRPO_STD_EPS) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` per row of ``groups`` ``[G, n]``; unbiased std."""
    mean = groups.mean(dim=-1, keepdim=True)
    std = groups.std(dim=-1, keepdim=True, correction=1)
    return (groups - mean) / (std + eps)


def dr_grpo_advantages(groups: torch.Tensor) -> torch.Tensor:
    """``r - mean`` per row of ``groups`` ``[G, n]`` (Dr. GRPO: no std normalisation)."""
    return groups - groups.mean(dim=-1, keepdim=True)


def rloo_advantages(groups: torch.Tensor) -> torch.Tensor:
    """``r_i - mean of the other n - 1 rewards`` per row of ``groups`` ``[G, n]``."""
    n = groups.shape[-1]
    others_mean = (groups.sum(dim=-1, keepdim=True) - groups) / (n - 1)
    return groups - others_mean


ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": lambda groups: groups,  # the raw reward; shaped and normalised per token
    "reinforce_pp_baseline": dr_grpo_advantages,  # then normalised over the batch's tokens
}


@dataclass
class AdvantageResult:
    """Per-sample advantages and what the caller needs to filter and log them."""

    advantages: torch.Tensor
    """[N] float32 advantage per sample (N = num_prompts * num_generations)."""
    keep_mask: torch.Tensor
    """[N] bool, False for every sample of a group whose rewards are all equal. Applying it is
    the caller's choice (``filter_zero_variance_groups``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``num_groups``, ``num_zero_variance_groups``, ``zero_variance_group_frac``."""


def compute_advantages(
    rewards: torch.Tensor, num_generations: int, estimator: AdvantageEstimator = "grpo"
) -> AdvantageResult:
    """Advantages of flat ``rewards``, grouped by prompt: consecutive runs of ``num_generations``
    samples form one group."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage estimator {estimator!r} is unknown; "
            f"use one of {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    if num_generations < 2:
        raise ValueError(
            f"num_generations={num_generations}: group advantages need at least 2 responses per "
            "prompt (a group of one has no baseline); set algorithm.num_generations >= 2"
        )
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be 1-D with num_prompts * num_generations entries; got shape "
            f"{tuple(rewards.shape)} for num_generations={num_generations}"
        )
    groups = rewards.to(torch.float32).view(-1, num_generations)
    zero_variance = groups.amax(dim=-1) == groups.amin(dim=-1)  # [G]

    advantages = ADVANTAGE_ESTIMATORS[estimator](groups)
    if estimator != "reinforce_pp":  # no group baseline there: an equal group still learns
        advantages = advantages.masked_fill(zero_variance.unsqueeze(-1), 0.0)

    num_groups = groups.shape[0]
    num_zero_variance = int(zero_variance.sum())
    return AdvantageResult(
        advantages=advantages.reshape(-1),
        keep_mask=(~zero_variance).repeat_interleave(num_generations),
        metrics={
            "num_groups": float(num_groups),
            "num_zero_variance_groups": float(num_zero_variance),
            "zero_variance_group_frac": num_zero_variance / max(num_groups, 1),
        },
    )


def token_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast sequence advantages ``[B]`` over their trained tokens: ``[B, T]`` float32,
    0 wherever ``loss_mask`` is 0."""
    if advantages.dim() != 1 or advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"advantages must be [B] for a [B, T] loss_mask; got {tuple(advantages.shape)} and "
            f"{tuple(loss_mask.shape)} (filter the batch and the advantages with the same mask)"
        )
    return advantages.to(torch.float32).unsqueeze(-1) * loss_mask.to(torch.float32)


def reinforce_pp_returns(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """REINFORCE++'s token returns ``[B, T]``: token reward ``-kl_coef * kl`` on every trained
    token plus the sequence reward on its last trained token, summed from each token to the end
    (gamma = 1); 0 off the mask."""
    mask = loss_mask.to(torch.float32)
    token_reward = torch.zeros_like(mask)
    if kl is not None and kl_coef > 0:
        token_reward = -kl_coef * kl.to(torch.float32) * mask
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).amax(dim=-1)  # -1: no trained token
    rows = (last >= 0).nonzero().squeeze(-1)
    token_reward[rows, last[rows]] += rewards.to(torch.float32)[rows]
    to_go = token_reward.flip(-1).cumsum(-1).flip(-1)
    return to_go * mask


def batch_normalise(
    values: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """``(v - mean) / (std + eps)`` with mean and (unbiased) std over every trained token of the
    batch; 0 off the mask."""
    mask = loss_mask.bool()
    picked = values[mask].to(torch.float32)
    if picked.numel() < 2:
        return torch.zeros_like(values, dtype=torch.float32)
    normalised = (values.to(torch.float32) - picked.mean()) / (picked.std(correction=1) + eps)
    return torch.where(mask, normalised, 0.0)


def overlong_penalty(
    lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment, as a positive amount to subtract from each reward: 0 up
    to ``max_tokens - buffer`` tokens, then rising linearly to ``penalty`` at ``max_tokens``."""
    over = (lengths.to(torch.float32) - (max_tokens - buffer)).clamp(min=0) / buffer
    return over.clamp(max=1.0) * penalty
