"""Losses for the trainer: the clipped policy gradient of PPO/GRPO and the NLL of SFT.

Every loss follows one contract (docs/architecture.md)::

    loss, metrics = loss_fn(logprobs, micro_batch, num_global_tokens, num_global_sequences)

``logprobs`` ``[b, T]`` carries the gradient; the two counts are over the whole batch (all
micro-batches, all data-parallel ranks). The loss is already divided by that global count, so
summing it over micro-batches and ranks gives the full-batch loss and the full-batch gradient.
Every metric is a detached scalar tensor normalised the same way, so metrics add up too
(``clip_frac`` = clipped tokens / ``num_global_tokens``). Token metrics (``kl``, ``clip_frac``,
``ratio_mean``, ``entropy``, ``importance_weight_mean``, ``rollout_correction/*``) are token
means whatever the aggregation; ``loss`` and ``pg_loss`` follow the configured aggregation.

KL direction: the estimators estimate ``KL(pi || pi_ref)`` from tokens sampled by ``pi``, with
``log r = ref_logprobs - logprobs`` (r = pi_ref / pi, Schulman's "Approximating KL divergence"):
``k1 = -log r`` (unbiased, can be negative per token), ``k2 = (log r)^2 / 2`` (biased, >= 0),
``k3 = (r - 1) - log r`` (unbiased, >= 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from tandem.data.batch import TrainBatch

Count = int | float | torch.Tensor
Metrics = dict[str, torch.Tensor]


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """``-log r``: log pi - log pi_ref."""
    return -log_ratio


def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """``(log r)^2 / 2``."""
    return 0.5 * log_ratio.square()


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``(r - 1) - log r``."""
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": k1, "k2": k2, "k3": k3}
"""Per-token KL estimators of ``log r = ref_logprobs - logprobs``."""


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def token_aggregate(
    values: torch.Tensor, mask: torch.Tensor, num_global_tokens: Count, num_global_sequences: Count
) -> torch.Tensor:
    """Sum over every trained token / ``num_global_tokens``: each token weighs the same."""
    return _masked_sum(values, mask) / _at_least_one(num_global_tokens)


def sequence_aggregate(
    values: torch.Tensor, mask: torch.Tensor, num_global_tokens: Count, num_global_sequences: Count
) -> torch.Tensor:
    """Mean over each sequence's tokens, summed / ``num_global_sequences``: each sequence weighs
    the same, so tokens of short responses weigh more."""
    per_sequence = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.sum() / _at_least_one(num_global_sequences)


RolloutCorrection = Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask", "icepop"]

Aggregator = Callable[[torch.Tensor, torch.Tensor, Count, Count], torch.Tensor]
AGGREGATORS: dict[str, Aggregator] = {"token": token_aggregate, "sequence": sequence_aggregate}


def _at_least_one(count: Count) -> Count:
    # A batch with no trained token contributes nothing; dividing by 1 keeps that a clean 0.
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of the clipped policy-gradient loss. The bounds are checked once, where the config
    loads (``AlgorithmConfig``); this is the loss's plain view of them."""

    clip_low: float = 0.2
    """The ratio is clipped below at ``1 - clip_low`` (for negative advantages). In [0, 1)."""
    clip_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_high`` (for positive advantages). >= 0.
    DAPO's clip-higher uses 0.28."""
    dual_clip: float | None = None
    """Dual-clip constant ``c > 1`` (Ye et al.): for negative advantages the token loss is capped
    at ``-c * A``, so a huge ratio cannot blow up the update. None disables."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy. 0 disables it and then
    ``reference_logprobs`` is not needed. >= 0."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Which per-token estimator of KL(pi || pi_ref); see the module docstring."""
    aggregation: Literal["token", "sequence"] = "token"
    """token: mean over all trained tokens; sequence: mean per sequence, then over sequences."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: PPO's per-token ratio; sequence: GSPO's (Zheng et al. 2025) length-normalised
    sequence ratio ``exp(mean_t(logprobs - old_logprobs))``, clipped per sequence; each token's
    gradient is the sequence ratio times its own ``grad log pi`` (use with ``aggregation:
    sequence``, as the paper does, and a small clip range, e.g. 3e-4 / 4e-4)."""
    rollout_correction: RolloutCorrection = "none"
    """How the loss corrects for the generator sampling from a slightly different distribution than
    the trainer's old policy, from ``w = exp(old_logprobs - generator_logprobs)`` per token
    (detached; off when the batch has no ``generator_logprobs``): ``token_tis`` weights each token
    by ``min(w, correction_high)``; ``seq_tis`` each sequence by ``min(W, correction_high)`` with
    ``W`` the geometric mean of its ``w`` (length-normalised, as GSPO's ratio); ``token_mask``
    weights a token by ``w`` inside ``[correction_low, correction_high]`` and drops it outside;
    ``seq_mask`` the same per sequence with ``W``; ``icepop`` drops the tokens outside the range
    and leaves the others unweighted (IcePop's two-sided masking)."""
    correction_low: float = 0.5
    """Lower bound of the kept range of the masking modes. In (0, 1]."""
    correction_high: float = 2.0
    """Cap of the truncating modes, upper bound of the kept range of the masking modes. >= 1."""


def clipped_token_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic per-token loss ``max(-A r, -A clip(r))``, then the dual-clip cap
    ``min(., -c A)`` for ``A < 0``. Returns the loss and where the clip / dual clip is active
    (those tokens get no gradient)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_dual_clipped = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        is_dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(is_dual_clipped, cap, loss)
    return loss, is_clipped, is_dual_clipped


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean of ``values`` over each row's masked tokens (0 for a row without any)."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


@dataclass(frozen=True)
class RolloutWeight:
    """A rollout correction per token: the weight, and where it truncated / masked (0/1)."""

    value: torch.Tensor
    truncated: torch.Tensor
    masked: torch.Tensor


def rollout_weight(
    log_w: torch.Tensor, mask: torch.Tensor, mode: RolloutCorrection, low: float, high: float
) -> RolloutWeight:
    """The weight of each token for ``mode`` from ``log_w = old - generator`` ``[B, T]`` (0 off
    the mask). Sequence modes use the geometric mean of the sequence's token ratios."""
    if mode in ("seq_tis", "seq_mask"):
        log_w = _sequence_mean(log_w, mask)[:, None].expand_as(log_w)
    w = torch.exp(log_w) * mask
    outside = ((w < low) | (w > high)) & mask.bool()
    none = torch.zeros_like(w)
    if mode in ("token_tis", "seq_tis"):
        return RolloutWeight(w.clamp(max=high), (w > high).to(w.dtype), none)
    kept = torch.where(outside, 0.0, w if mode != "icepop" else mask)
    return RolloutWeight(kept, none, outside.to(w.dtype))


class ClippedPolicyLoss:
    """The GRPO/PPO policy loss: clipped ratio to ``old_logprobs`` (clip-higher, dual clip),
    optional truncated importance weight to the generator, optional KL penalty to the reference.

    ``old_logprobs=None`` means on-policy (a single update per batch): the ratio is 1 in value and
    the gradient is the plain policy gradient.
    """

    def __init__(self, config: PolicyLossConfig | None = None) -> None:
        self.config = config or PolicyLossConfig()
        self.kl_estimator = KL_ESTIMATORS[self.config.kl_estimator]
        self.aggregate = AGGREGATORS[self.config.aggregation]

    def __call__(
        self,
        logprobs: torch.Tensor,
        micro_batch: TrainBatch,
        num_global_tokens: Count,
        num_global_sequences: Count,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        cfg = self.config
        if micro_batch.advantages is None:
            raise ValueError(
                "TrainBatch.advantages is None: set it (token_advantages) before train"
            )
        mask = micro_batch.loss_mask.to(logprobs.dtype)
        where = mask.bool()

        def per_token_mean(values: torch.Tensor) -> torch.Tensor:
            return token_aggregate(values.detach(), mask, num_global_tokens, num_global_sequences)

        old = micro_batch.old_logprobs
        old = logprobs.detach() if old is None else old.to(logprobs.dtype)
        # Masked entries (prompt, padding) may hold anything: zero the log-ratio there so exp()
        # cannot turn garbage into inf * 0 = nan.
        log_ratio = torch.where(where, logprobs - old, 0.0)
        if cfg.ratio_level == "sequence":  # GSPO: the sequence's value, each token's gradient
            sequence = _sequence_mean(log_ratio.detach(), mask)[:, None]
            log_ratio = sequence + logprobs - logprobs.detach()
            log_ratio = torch.where(where, log_ratio, 0.0)
        ratio = torch.exp(log_ratio)
        advantages = micro_batch.advantages.to(logprobs.dtype)
        pg_token, is_clipped, is_dual_clipped = clipped_token_loss(
            ratio, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip
        )
        metrics: Metrics = {
            "clip_frac": per_token_mean(is_clipped.to(mask.dtype)),
            "ratio_mean": per_token_mean(ratio),
        }
        if cfg.dual_clip is not None:
            metrics["dual_clip_frac"] = per_token_mean(is_dual_clipped.to(mask.dtype))

        weight = self._rollout_weight(old, micro_batch.generator_logprobs, mask)
        if weight is not None:
            pg_token = pg_token * weight.value
            metrics["importance_weight_mean"] = per_token_mean(weight.value)
            metrics["rollout_correction/truncated_frac"] = per_token_mean(weight.truncated)
            metrics["rollout_correction/masked_frac"] = per_token_mean(weight.masked)
        total_token = pg_token

        kl_token = self._kl(logprobs, micro_batch.reference_logprobs, where)
        if kl_token is not None:
            metrics["kl"] = per_token_mean(kl_token)
            if cfg.kl_coef > 0:
                total_token = total_token + cfg.kl_coef * kl_token
        if entropy is not None:
            metrics["entropy"] = per_token_mean(entropy)
        if micro_batch.generator_logprobs is not None:
            # the generator/trainer mismatch after the last refit, from this very forward
            generator = micro_batch.generator_logprobs.to(logprobs.dtype)
            gap = torch.where(where, (logprobs - generator).abs(), 0.0)
            metrics["logprob_mismatch"] = per_token_mean(gap)

        loss = self.aggregate(total_token, mask, num_global_tokens, num_global_sequences)
        metrics["pg_loss"] = self.aggregate(
            pg_token.detach(), mask, num_global_tokens, num_global_sequences
        )
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _rollout_weight(
        self, old: torch.Tensor, generator_logprobs: torch.Tensor | None, mask: torch.Tensor
    ) -> RolloutWeight | None:
        """The per-token weight of ``rollout_correction`` (see ``PolicyLossConfig``), or None."""
        mode = self.config.rollout_correction
        if mode == "none" or generator_logprobs is None:
            return None
        return rollout_weight(
            torch.where(mask.bool(), old - generator_logprobs.to(old.dtype), 0.0),
            mask,
            mode,
            self.config.correction_low,
            self.config.correction_high,
        )

    def _kl(
        self, logprobs: torch.Tensor, reference_logprobs: torch.Tensor | None, where: torch.Tensor
    ) -> torch.Tensor | None:
        """Per-token KL(pi || pi_ref) estimate, or None when there is no reference to compare."""
        if reference_logprobs is None:
            if self.config.kl_coef > 0:
                raise ValueError(
                    f"kl_coef={self.config.kl_coef} needs TrainBatch.reference_logprobs; compute "
                    "them with the reference policy or set kl_coef=0"
                )
            return None
        log_ratio = torch.where(where, reference_logprobs.to(logprobs.dtype) - logprobs, 0.0)
        return self.kl_estimator(log_ratio)


def nll_loss(
    logprobs: torch.Tensor,
    micro_batch: TrainBatch,
    num_global_tokens: Count,
    num_global_sequences: Count,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SFT: mean negative log-likelihood over the loss-masked tokens of the whole batch."""
    mask = micro_batch.loss_mask.to(logprobs.dtype)
    loss = token_aggregate(-logprobs, mask, num_global_tokens, num_global_sequences)
    metrics: Metrics = {"loss": loss.detach()}
    if entropy is not None:
        metrics["entropy"] = token_aggregate(
            entropy.detach(), mask, num_global_tokens, num_global_sequences
        )
    return loss, metrics
