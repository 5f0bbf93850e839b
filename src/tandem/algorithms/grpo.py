"""GRPO, synchronous: generate, score, compute advantages, train, refit — one step at a time.

The loop talks to the workers only through a ``RolloutRuntime`` (``algorithms/protocols.py``) and
never branches on placement, transport or memory phases; everything here is tensors and typed
batches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tandem.algorithms.advantages import compute_advantages, token_advantages
from tandem.algorithms.losses import ClippedPolicyLoss, PolicyLossConfig
from tandem.algorithms.protocols import RolloutRuntime
from tandem.algorithms.rollouts import rollouts_to_batch, score_rollouts
from tandem.config.models import GrpoConfig, SamplingConfig
from tandem.data.prompts import PromptSource
from tandem.generation.base import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    metrics: dict[str, float]


def policy_loss(config: GrpoConfig) -> ClippedPolicyLoss:
    algo = config.algorithm
    return ClippedPolicyLoss(
        PolicyLossConfig(
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            aggregation=algo.aggregation,
            importance_cap=algo.importance_cap,
        )
    )


def grpo_step(
    runtime: RolloutRuntime,
    config: GrpoConfig,
    prompts: list[dict[str, str]],
    step: int,
    source: PromptSource,
) -> StepResult:
    """One GRPO step on ``prompts``; returns the step's metrics.

    With one optimizer step per batch the policy that generated the data is the one being
    trained, so the old logprobs are the training forward's own (the ratio is 1): no separate
    logprob pass; the generator/trainer mismatch comes from that same forward (the loss's
    ``logprob_mismatch`` metric)."""
    algo = config.algorithm
    timings: dict[str, float] = {}
    start = time.perf_counter()

    base_seed = config.generation.sampling.seed
    params = SamplingParams.from_config(
        config.generation.sampling,
        n=algo.num_generations,
        # a fresh stream per step, and the same one for the same step after a resume
        seed=None if base_seed is None else base_seed + step * 1_000_003,
    )
    prompt_ids = [source.encode(p["prompt"]) for p in prompts]
    rollouts = runtime.generate(prompt_ids, params)
    timings["timing/generate_s"] = time.perf_counter() - start

    scores = score_rollouts(source.reward, prompts, rollouts, source.decode)
    rewards = torch.tensor(scores.rewards, dtype=torch.float32)
    adv = compute_advantages(rewards, algo.num_generations, algo.advantage)
    batch = rollouts_to_batch(rollouts, pad_token_id=source.pad_token_id)
    if algo.filter_zero_variance_groups and bool(adv.keep_mask.any()):
        keep = adv.keep_mask.nonzero().squeeze(-1)
        batch, advantages = batch.select(keep), adv.advantages[keep]
    else:
        advantages = adv.advantages
    batch.advantages = token_advantages(advantages, batch.loss_mask)

    t0 = time.perf_counter()
    if algo.kl_coef > 0:
        batch.reference_logprobs = runtime.reference_logprobs(batch)
    timings["timing/logprobs_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    train_metrics = runtime.train(batch, policy_loss(config))
    timings["timing/train_s"] = time.perf_counter() - t0
    mismatch = train_metrics["logprob_mismatch"]
    if mismatch > config.refit.logprob_mismatch_alarm:
        log.warning(
            "step %d: generator/trainer logprob mismatch %.3g exceeds refit.logprob_mismatch_alarm"
            " %.3g (stale weights or KV cache in the generator?)",
            step,
            mismatch,
            config.refit.logprob_mismatch_alarm,
        )

    t0 = time.perf_counter()
    refit_stats = runtime.refit()
    timings["timing/refit_s"] = time.perf_counter() - t0
    timings["timing/step_s"] = time.perf_counter() - start

    num_tokens = int(batch.attention_mask.sum())
    metrics = {
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "train/response_len_mean": float(batch.loss_mask.sum(-1).float().mean()),
        "train/zero_variance_groups": adv.metrics["zero_variance_group_frac"],
        "train/kl": train_metrics.get("kl", 0.0),
        "train/clip_frac": train_metrics.get("clip_frac", 0.0),
        "train/entropy": train_metrics.get("entropy", 0.0),
        "train/loss": train_metrics["loss"],
        "train/grad_norm": train_metrics["grad_norm"],
        "train/lr": train_metrics["lr"],
        "gen/logprob_mismatch": mismatch,
        "refit/gb_per_s": refit_stats.get("gb_per_s", 0.0),
        "throughput/tokens_per_s": num_tokens / timings["timing/step_s"],
        **timings,
    }
    return StepResult(metrics=metrics)


def evaluate(
    runtime: RolloutRuntime, source: PromptSource, num_prompts: int, sampling: SamplingConfig
) -> dict[str, float]:
    """Greedy accuracy on the fixed held-out prompts."""
    prompts = source.eval_prompts(num_prompts)
    params = SamplingParams(
        temperature=0.0, max_tokens=sampling.max_tokens, stop=tuple(sampling.stop)
    )
    rollouts = runtime.generate([source.encode(p["prompt"]) for p in prompts], params)
    scores = score_rollouts(source.reward, prompts, rollouts, source.decode)
    return {"eval/accuracy": sum(scores.rewards) / len(scores.rewards)}
