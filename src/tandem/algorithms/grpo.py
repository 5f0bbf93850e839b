"""GRPO, synchronous: generate, score, compute advantages, train, refit — one step at a time.

The loop talks to the workers only through a ``RolloutRuntime`` (``algorithms/protocols.py``) and
never branches on placement, transport or memory phases; everything here is tensors and typed
batches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.algorithms.advantages import (
    BATCH_NORMALISED,
    batch_normalise,
    compute_advantages,
    overlong_penalty,
    reinforce_pp_returns,
    token_advantages,
)
from tandem.algorithms.distillation import distill_advantages
from tandem.algorithms.losses import KL_ESTIMATORS, ClippedPolicyLoss, PolicyLossConfig
from tandem.algorithms.multiturn import (
    EpisodeLimits,
    episode_metrics,
    episode_rollout,
    run_episodes,
)
from tandem.algorithms.protocols import WORKER_METRICS, RolloutRuntime
from tandem.algorithms.rollouts import Scores, rollouts_to_batch, score_rollouts
from tandem.config.models import GrpoConfig, SamplingConfig
from tandem.contracts import LossFn
from tandem.data.batch import TrainBatch
from tandem.data.prompts import PromptSource
from tandem.data.turns import TurnEncoder
from tandem.generation.base import Rollout, SamplingParams

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
            # REINFORCE++ puts the KL into the token rewards, not into the loss
            kl_coef=0.0 if algo.advantage == "reinforce_pp" else algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            aggregation=algo.aggregation,
            ratio_level="sequence" if algo.policy_loss == "gspo" else "token",
            rollout_correction=algo.rollout_correction,
            correction_low=algo.correction_low,
            correction_high=algo.correction_high,
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
    ``logprob_mismatch`` metric). Several updates per batch (``ppo_epochs``,
    ``num_minibatches``) take the old logprobs from a separate pass first."""
    start = time.perf_counter()
    groups = _generate(runtime, config, source, prompts, step)
    timings = {"timing/generate_s": time.perf_counter() - start}
    metrics = train_on_groups(runtime, config, groups, step, source, timings)
    t0 = time.perf_counter()
    refit_stats = runtime.refit(version=step)
    timings["timing/refit_s"] = time.perf_counter() - t0
    timings["timing/step_s"] = time.perf_counter() - start
    metrics["refit/gb_per_s"] = refit_stats.get("gb_per_s", 0.0)
    metrics["throughput/tokens_per_s"] = metrics.pop("num_tokens") / timings["timing/step_s"]
    return StepResult(metrics={**metrics, **timings})


def train_on_groups(
    runtime: RolloutRuntime,
    config: GrpoConfig,
    groups: Groups,
    step: int,
    source: PromptSource,
    timings: dict[str, float],
    fresh: bool = True,
) -> dict[str, float]:
    """Advantages, logprob passes and the update(s) of step ``step`` on scored ``groups``: the
    step's metrics (``num_tokens``: the batch's tokens); its phases' seconds go to ``timings``.
    ``fresh``: the rollouts come from the policy being trained, so a logprob mismatch means a
    bad refit (stale rollouts of async GRPO differ by design: no alarm)."""
    algo = config.algorithm
    rollouts, rewards = groups.rollouts, torch.tensor(groups.rewards, dtype=torch.float32)
    adv = compute_advantages(rewards, algo.num_generations, algo.advantage)
    batch = rollouts_to_batch(rollouts, pad_token_id=source.pad_token_id)
    if algo.filter_zero_variance_groups and bool(adv.keep_mask.any()):
        keep = adv.keep_mask.nonzero().squeeze(-1)
        batch, advantages, rewards = batch.select(keep), adv.advantages[keep], rewards[keep]
    else:
        advantages = adv.advantages

    t0 = time.perf_counter()
    if algo.kl_coef > 0:
        batch.reference_logprobs = runtime.reference_logprobs(batch)
    updates = algo.ppo_epochs * algo.num_minibatches
    if updates > 1:
        batch.old_logprobs = runtime.policy_logprobs(batch)
    timings["timing/logprobs_s"] = time.perf_counter() - t0
    batch.advantages = _token_advantages(config, batch, advantages, rewards)
    distill = _distill(config, batch, source, timings)

    t0 = time.perf_counter()
    train_metrics = _update(runtime, batch, policy_loss(config), config, step)
    timings["timing/train_s"] = time.perf_counter() - t0
    mismatch = train_metrics["logprob_mismatch"]
    if fresh and mismatch > config.refit.logprob_mismatch_alarm:
        log.warning(
            "step %d: generator/trainer logprob mismatch %.3g exceeds refit.logprob_mismatch_alarm"
            " %.3g (stale weights or KV cache in the generator?)",
            step,
            mismatch,
            config.refit.logprob_mismatch_alarm,
        )

    return {
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "train/response_len_mean": float(batch.loss_mask.sum(-1).float().mean()),
        "train/zero_variance_groups": adv.metrics["zero_variance_group_frac"],
        **groups.metrics,
        **{f"train/{k}": v for k, v in train_metrics.items() if k in _TRAIN_METRICS},
        **{k: v for k, v in train_metrics.items() if k.startswith(_PASSED_THROUGH)},
        "train/kl": train_metrics.get("kl", 0.0),
        "train/clip_frac": train_metrics.get("clip_frac", 0.0),
        "train/entropy": train_metrics.get("entropy", 0.0),
        "gen/logprob_mismatch": mismatch,
        **distill,
        "num_tokens": float(batch.attention_mask.sum()),
    }


def _distill(
    config: GrpoConfig, batch: TrainBatch, source: PromptSource, timings: dict[str, float]
) -> dict[str, float]:
    """With ``algorithm.teacher``: the teacher's per-token reverse-KL advantage added to the
    batch's advantages (``algorithms.distillation``); its metrics."""
    scorers = getattr(source, "scorers", None)
    if config.algorithm.teacher is None or scorers is None:
        return {}
    assert batch.advantages is not None and batch.generator_logprobs is not None
    t0 = time.perf_counter()
    teacher = scorers.teacher_logprobs(batch)
    timings["timing/teacher_s"] = time.perf_counter() - t0
    extra, metrics = distill_advantages(
        teacher, batch.generator_logprobs, batch.loss_mask, config.algorithm.distill_coef
    )
    batch.advantages = batch.advantages + extra
    return metrics


_TRAIN_METRICS = ("loss", "grad_norm", "lr", "importance_weight_mean", "updates")
_PASSED_THROUGH = ("rollout_correction/", *WORKER_METRICS)
"""Trainer metrics logged under their own names."""


@dataclass
class Groups:
    """Scored rollouts, ``num_generations`` consecutive ones per prompt."""

    rollouts: list[Rollout]
    rewards: list[float]
    metrics: dict[str, float]


def _generate(
    runtime: RolloutRuntime,
    config: GrpoConfig,
    source: PromptSource,
    prompts: list[dict[str, str]],
    step: int,
) -> Groups:
    """Generate and score ``prompts``; with ``refill_rounds``, keep only groups of non-zero
    reward variance and generate for fresh prompts until there are ``prompts_per_step`` of them
    or the rounds run out (DAPO's dynamic sampling)."""
    algo = config.algorithm
    n = algo.num_generations
    rollouts, rewards, scoring = _generate_round(runtime, config, source, prompts, step, 0)
    if not (algo.filter_zero_variance_groups and algo.refill_rounds > 0):
        return Groups(rollouts, rewards, scoring)
    generated = len(prompts)
    kept_rollouts: list[Rollout] = []
    kept_rewards: list[float] = []
    rounds = 0
    while True:
        for g in range(len(rewards) // n):
            group = rewards[g * n : (g + 1) * n]
            if max(group) != min(group) and len(kept_rewards) < algo.prompts_per_step * n:
                kept_rollouts += rollouts[g * n : (g + 1) * n]
                kept_rewards += group
        missing = algo.prompts_per_step - len(kept_rewards) // n
        if missing == 0 or rounds == algo.refill_rounds:
            break
        rounds += 1
        more = source.refill_prompts(step, rounds, missing)
        generated += len(more)
        rollouts, rewards, more_scoring = _generate_round(
            runtime, config, source, more, step, rounds
        )
        scoring = {key: value + more_scoring.get(key, 0.0) for key, value in scoring.items()}
    metrics = {
        **scoring,
        "train/refill_rounds": float(rounds),
        "train/kept_group_frac": len(kept_rewards) / n / generated,
    }
    if not kept_rewards:  # nothing of variance in any round: train on the last round as it is
        return Groups(rollouts, rewards, metrics)
    return Groups(kept_rollouts, kept_rewards, metrics)


def _generate_round(
    runtime: RolloutRuntime,
    config: GrpoConfig,
    source: PromptSource,
    prompts: list[dict[str, str]],
    step: int,
    round_index: int,
) -> tuple[list[Rollout], list[float], dict[str, float]]:
    """Rollouts of ``prompts``, their rewards and the scorer's metrics (multi-turn episodes
    and the environments' rewards with an ``environment`` section)."""
    params = rollout_params(config, step, round_index)
    if config.environment is not None:
        return episode_round(runtime, config, source, prompts, params)
    rollouts = runtime.generate([source.encode_prompt(p) for p in prompts], params)
    return rollouts, *score(config, source, prompts, rollouts, params)


def episode_round(
    runtime: RolloutRuntime,
    config: GrpoConfig,
    source: PromptSource,
    prompts: list[dict[str, str]],
    params: SamplingParams,
) -> tuple[list[Rollout], list[float], dict[str, float]]:
    """``params.n`` episodes per prompt against ``source.environments``, as rollouts (the
    environments' turns masked out), their summed rewards and the episodes' metrics."""
    env = config.environment
    assert env is not None
    if source.environments is None:
        raise ValueError("config.environment is set but the prompt source has no environments")
    episodes = run_episodes(
        prompts,
        params.n,
        runtime.generate,
        source.environments,
        TurnEncoder(source.tokenizer, env.chat_template),
        params,
        EpisodeLimits(max_turns=env.max_turns, max_tokens=env.max_tokens),
    )
    rollouts = [episode_rollout(e, source.pad_token_id) for e in episodes]
    return rollouts, [e.reward for e in episodes], episode_metrics(episodes)


def rollout_params(config: GrpoConfig, step: int, round_index: int = 0) -> SamplingParams:
    """Sampling of step ``step``'s rollouts: a fresh stream per step and round, and the same one
    for the same step after a resume."""
    base_seed = config.generation.sampling.seed
    return SamplingParams.from_config(
        config.generation.sampling,
        n=config.algorithm.num_generations,
        seed=None if base_seed is None else base_seed + step * 1_000_003 + round_index * 7_919,
    )


def score(
    config: GrpoConfig,
    source: PromptSource,
    prompts: list[dict[str, str]],
    rollouts: list[Rollout],
    params: SamplingParams,
) -> tuple[list[float], dict[str, float]]:
    """Each rollout's reward, less DAPO's overlong penalty when configured, and the scorer's
    metrics (invalid and timed-out rewards, the seconds scoring took)."""
    algo = config.algorithm
    scores = score_rollouts(source.reward, prompts, rollouts, source.decode)
    scorers = getattr(source, "scorers", None)
    if scorers is not None or config.reward.rule_weight != 1.0:
        scores = _add_model_scores(scorers, config, prompts, rollouts, source, scores)
    rewards = scores.rewards
    if algo.overlong_buffer > 0:
        lengths = torch.tensor([len(r.response_token_ids) for r in rollouts])
        penalty = overlong_penalty(
            lengths, params.max_tokens, algo.overlong_buffer, algo.overlong_penalty
        )
        rewards = [r - float(p) for r, p in zip(rewards, penalty, strict=True)]
    return rewards, scores.metrics


def _add_model_scores(
    scorers: Any,
    config: GrpoConfig,
    prompts: list[dict[str, str]],
    rollouts: list[Rollout],
    source: PromptSource,
    rule: Scores,
) -> Scores:
    """The rule's scores weighted by ``reward.rule_weight``, plus the reward model's and the
    judge's (``cluster.scorers.ModelScorers.score``), each part logged."""
    if scorers is None:  # no model: only the rule's weight
        weight = config.reward.rule_weight
        return Scores([weight * r for r in rule.rewards], {**rule.metrics})
    samples = []
    for rollout in rollouts:
        item = prompts[rollout.prompt_index]
        response = rollout.response_text or source.decode(rollout.response_token_ids)
        samples.append((item["prompt"], response, item["answer"]))
    return scorers.score(samples, rule)  # type: ignore[no-any-return]


def _token_advantages(
    config: GrpoConfig, batch: TrainBatch, advantages: torch.Tensor, rewards: torch.Tensor
) -> torch.Tensor:
    """Per-token advantages ``[B, T]`` of the estimator (REINFORCE++ shapes and normalises them
    over the batch's tokens)."""
    algo = config.algorithm
    if algo.advantage == "reinforce_pp":
        kl = None
        if batch.reference_logprobs is not None and batch.generator_logprobs is not None:
            log_r = batch.reference_logprobs - batch.generator_logprobs
            kl = KL_ESTIMATORS[algo.kl_estimator](log_r) * batch.loss_mask
        returns = reinforce_pp_returns(rewards, batch.loss_mask, kl, algo.kl_coef)
        return batch_normalise(returns, batch.loss_mask)
    tokens = token_advantages(advantages, batch.loss_mask)
    if algo.advantage in BATCH_NORMALISED:
        return batch_normalise(tokens, batch.loss_mask)
    return tokens


def _update(
    runtime: RolloutRuntime, batch: TrainBatch, loss: LossFn, config: GrpoConfig, step: int
) -> dict[str, float]:
    """One optimizer step on ``batch``, or ``ppo_epochs`` passes of ``num_minibatches`` steps
    over its shuffled rows; the metrics are the updates' means, the mismatch the old policy's."""
    algo = config.algorithm
    if algo.ppo_epochs * algo.num_minibatches == 1:
        return {**runtime.train(batch, loss), "updates": 1.0}
    assert batch.old_logprobs is not None and batch.generator_logprobs is not None
    every: list[dict[str, float]] = []
    order_rng = torch.Generator().manual_seed(algo.seed * 1_000_003 + step)
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(batch.num_sequences, generator=order_rng)
        for rows in order.tensor_split(algo.num_minibatches):
            if rows.numel():
                every.append(runtime.train(batch.select(rows), loss))
    merged = {k: sum(m[k] for m in every) / len(every) for k in every[0]}
    mask = batch.loss_mask
    gap = (batch.old_logprobs - batch.generator_logprobs).abs() * mask
    merged["logprob_mismatch"] = float(gap.sum() / mask.sum().clamp(min=1))
    merged["updates"] = float(len(every))
    return merged


def evaluate(
    runtime: RolloutRuntime,
    source: PromptSource,
    num_prompts: int,
    sampling: SamplingConfig,
    config: GrpoConfig | None = None,
) -> dict[str, float]:
    """Greedy accuracy on the fixed held-out prompts (multi-turn, with ``config.environment``:
    the share of episodes with a positive reward, and the mean reward)."""
    prompts = source.eval_prompts(num_prompts)
    params = SamplingParams(
        temperature=0.0, max_tokens=sampling.max_tokens, stop=tuple(sampling.stop)
    )
    if config is not None and config.environment is not None:
        _, rewards, _ = episode_round(runtime, config, source, prompts, params)
        return {
            "eval/accuracy": sum(r > 0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards),
        }
    rollouts = runtime.generate([source.encode_prompt(p) for p in prompts], params)
    scores = score_rollouts(source.reward, prompts, rollouts, source.decode)
    return {
        "eval/accuracy": sum(scores.rewards) / len(scores.rewards),
        **{
            f"eval/{key.removeprefix('reward/')}": value
            for key, value in scores.metrics.items()
            if key.startswith("reward/")
        },
    }
