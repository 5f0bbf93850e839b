"""DPO and IPO on preference pairs, with the trainer and runtime of every other algorithm.

A pair's *margin* is ``m = (log pi - log ref)(chosen) - (log pi - log ref)(rejected)``, each term a
response's summed token logprobs. DPO (Rafailov et al. 2023) minimises ``-log sigmoid(beta m)``,
IPO (Azar et al. 2023) ``(m - 1 / (2 beta))^2``, averaged over the pairs.

How it trains without keeping the two rows of a pair in one micro-batch: the loss is a function of
the margin only, so its gradient is ``dL/dm * (grad log pi(chosen) - grad log pi(rejected))``.
A no-grad pass of the current policy gives ``m`` and ``dL/dm``; the trainer then minimises the
policy-gradient form ``-sum_t A_t log pi_t / num_pairs`` with the per-sequence weight
``A = -dL/dm`` on the chosen row and ``+dL/dm`` on the rejected one. Same weights, same gradient
as the pairwise loss, so any micro-batching, packing or data-parallel split of the rows is exact;
the price is that extra forward pass. The reported loss is the pairwise loss itself (plus the
optional NLL of the chosen responses, ``nll_coef``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.algorithms.protocols import RolloutRuntime, worker_metrics
from tandem.config.dpo import DpoAlgorithmConfig
from tandem.contracts import Count, Metrics
from tandem.data.batch import TrainBatch
from tandem.data.preferences import Pair, preference_batch
from tandem.data.prompts import PromptSource


def sequence_logprobs(token_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each response's summed token logprobs."""
    return (token_logprobs * loss_mask).sum(-1)


def margins(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[P]`` pair margins from ``[2P]`` sequence logprobs, rows ``2i`` chosen and ``2i + 1``
    rejected."""
    log_ratio = policy - reference
    return log_ratio[0::2] - log_ratio[1::2]


def pair_losses(margin: torch.Tensor, beta: float, kind: str) -> torch.Tensor:
    """``[P]`` per-pair DPO or IPO loss of the margins."""
    if kind == "dpo":
        return -F.logsigmoid(beta * margin)
    if kind == "ipo":
        return (margin - 1.0 / (2.0 * beta)).square()
    raise ValueError(f"unknown preference loss {kind!r} (allowed: dpo, ipo)")


@dataclass
class PairStats:
    margin: torch.Tensor
    """[P] pair margins."""
    loss: torch.Tensor
    """[P] per-pair loss."""
    weight: torch.Tensor
    """[2P] per-sequence weight ``A`` of the policy-gradient form (module docstring)."""
    chosen_logprob: torch.Tensor
    """[P] the chosen responses' summed logprobs under the policy."""


def pair_stats(
    policy: torch.Tensor, reference: torch.Tensor, beta: float, kind: str, nll_coef: float = 0.0
) -> PairStats:
    """Margins, losses and per-sequence weights from ``[2P]`` sequence logprobs (no grad). With
    ``nll_coef`` the loss adds ``-nll_coef * log pi(chosen)`` per pair (RPO): weight
    ``nll_coef`` on the chosen rows."""
    margin = margins(policy, reference).detach().double().requires_grad_(True)
    loss = pair_losses(margin, beta, kind)
    (dloss_dmargin,) = torch.autograd.grad(loss.sum(), margin)
    weight = torch.stack([nll_coef - dloss_dmargin, dloss_dmargin], dim=1).reshape(-1)
    chosen = policy[0::2].detach().double()
    loss = loss.detach() - nll_coef * chosen
    return PairStats(margin.detach().float(), loss.float(), weight.float(), chosen.float())


def preference_gradient_loss(
    logprobs: torch.Tensor,
    micro_batch: TrainBatch,
    num_global_tokens: Count,
    num_global_sequences: Count,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """``-sum_t A_t log pi_t / num_pairs`` (``A`` in ``micro_batch.advantages``): its gradient is
    the pairwise loss's (``LossFn`` contract; every row is one of ``2 num_pairs`` sequences)."""
    assert micro_batch.advantages is not None, "preference_gradient_loss needs the weights"
    num_pairs = max(float(num_global_sequences) / 2.0, 1.0)
    weighted = micro_batch.advantages * logprobs * micro_batch.loss_mask
    return -weighted.sum() / num_pairs, {}


def score_pairs(
    runtime: RolloutRuntime, source: PromptSource, pairs: list[Pair], algo: DpoAlgorithmConfig
) -> tuple[TrainBatch, PairStats]:
    """The pairs' batch and their statistics under the current policy and the reference."""
    batch = preference_batch(source, pairs)
    reference = sequence_logprobs(runtime.reference_logprobs(batch), batch.loss_mask)
    policy = sequence_logprobs(runtime.policy_logprobs(batch), batch.loss_mask)
    return batch, pair_stats(policy, reference, algo.beta, algo.loss, algo.nll_coef)


def summary(stats: PairStats, beta: float, prefix: str) -> dict[str, float]:
    """Loss, preference accuracy (margin > 0), mean margin and chosen logprob, under
    ``prefix``."""
    return {
        f"{prefix}/loss": float(stats.loss.mean()),
        f"{prefix}/preference_accuracy": float((stats.margin > 0).float().mean()),
        f"{prefix}/margin": float(stats.margin.mean()),
        f"{prefix}/reward_margin": float(beta * stats.margin.mean()),
        f"{prefix}/chosen_logprob": float(stats.chosen_logprob.mean()),
    }


def dpo_step(
    runtime: RolloutRuntime, source: PromptSource, step: int, algo: DpoAlgorithmConfig
) -> dict[str, float]:
    """One optimizer step on the ``algo.batch_size`` pairs of step ``step`` (1-based)."""
    start = time.perf_counter()
    pairs = source.train_prompts(step - 1, algo.batch_size)
    batch, stats = score_pairs(runtime, source, pairs, algo)
    scored = time.perf_counter()
    batch.advantages = stats.weight[:, None] * batch.loss_mask
    trained = runtime.train(batch, preference_gradient_loss)
    end = time.perf_counter()
    return {
        **summary(stats, algo.beta, "train"),
        "train/grad_norm": trained["grad_norm"],
        "train/lr": trained["lr"],
        "timing/logprobs_s": scored - start,
        "timing/train_s": end - scored,
        "timing/step_s": end - start,
        "throughput/tokens_per_s": float(batch.attention_mask.sum()) / (end - start),
        **worker_metrics(trained),
    }
