"""Async GRPO's rollout pipeline with the real workers in this process (``LocalGroup``: the
generator works in its own thread while the trainer trains): the staleness bound, when it refits,
the versions on rollouts, and the prompt accounting across a restart."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from tandem.algorithms.async_grpo import RolloutPipeline
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.cluster.groups import LocalGroup
from tandem.cluster.runtime import Runtime
from tandem.config import GrpoConfig, load_config
from tandem.data.prompts import make_prompt_source
from tandem.rewards import load_reward


def _config(tmp_path: Path, *overrides: str) -> GrpoConfig:
    return load_config(
        GrpoConfig,
        "grpo_arithmetic",
        [
            "cluster.placement=split",
            "generation.backend=hf",
            "algorithm.prompts_per_step=4",
            "algorithm.num_generations=4",
            "algorithm.num_steps=5",
            "algorithm.rollout_correction=token_tis",
            "policy.micro_batch_size=16",
            f"logging.run_dir={tmp_path}",
            *overrides,
        ],
    )


def _runtime(config: GrpoConfig) -> Runtime:
    trainer = TrainerWorker(
        policy=config.policy,
        refit=config.refit.model_copy(update={"transport": "colocated"}),
        generation=config.generation,
    )
    generator = GeneratorWorker(generation=config.generation, model_path=str(DEFAULT_MODEL_DIR))
    return Runtime(LocalGroup([trainer], "trainer"), LocalGroup([generator], "generator"))


def _digest(source, step: int) -> float:  # type: ignore[no-untyped-def]
    prompts = source.train_prompts(step - 1, 4)
    return float(zlib.crc32("\n".join(p["prompt"] for p in prompts).encode()))


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_pipeline_keeps_the_bound_and_refits_only_when_it_must(
    tmp_path: Path, max_staleness: int
) -> None:
    config = _config(tmp_path, f"algorithm.max_staleness={max_staleness}")
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    with _runtime(config) as runtime:
        pipeline = RolloutPipeline(runtime, config, source)
        records = [pipeline.step(step) for step in range(1, 6)]
        # evaluation sees the policy just trained: the last step's weights reach the generator
        pipeline.sync_weights()
        assert pipeline.version == 5

    stale = [r["async/staleness_max"] for r in records]
    refits = [r["async/refit"] for r in records]
    assert max(stale) == max_staleness and stale[0] == 0.0
    assert all(r["async/staleness_mean"] == r["async/staleness_max"] for r in records)
    if max_staleness == 1:  # step s+1 generates while step s trains; a refit after each step
        assert stale == [0.0, 1.0, 1.0, 1.0, 1.0]
        assert refits == [1.0, 1.0, 1.0, 0.0, 0.0]  # steps 4-5 need no newer weights
    else:  # two versions of slack: fewer refits, older rollouts
        assert stale == [0.0, 1.0, 2.0, 1.0, 2.0]
        assert refits == [0.0, 1.0, 0.0, 0.0, 0.0]
    # generation ran ahead: the next step's rollouts were in flight while a step trained
    assert all(r["async/rollouts_in_flight"] == 16.0 for r in records[:-1])
    assert records[-1]["async/rollouts_in_flight"] == 0.0
    # every step trained its own prompts, once, in data order
    assert [r["data/prompt_digest"] for r in records] == [_digest(source, s) for s in range(1, 6)]
    assert [r["data/prompt_start"] for r in records] == [0.0, 4.0, 8.0, 12.0, 16.0]
    # stale tokens were reweighted against the generator's logprobs
    assert all("rollout_correction/truncated_frac" in r for r in records)
    assert all(r["timing/trainer_idle_s"] >= 0 and "num_tokens" not in r for r in records)


def test_a_restarted_pipeline_regenerates_what_ran_ahead(tmp_path: Path) -> None:
    """What was generated ahead of a checkpoint is lost with the process: a pipeline started
    at step 3 generates step 3's prompts again from the weights it holds (staleness 0)."""
    config = _config(tmp_path, "algorithm.max_staleness=1")
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    with _runtime(config) as runtime:
        first = RolloutPipeline(runtime, config, source)
        records = [first.step(step) for step in (1, 2)]
        assert first.done or first.running is not None  # step 3 was under way
        resumed = RolloutPipeline(runtime, config, source)
        records += [resumed.step(step) for step in (3, 4, 5)]
    assert [r["data/prompt_digest"] for r in records] == [_digest(source, s) for s in range(1, 6)]
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 0.0, 1.0, 1.0]


def test_max_staleness_needs_split_placement_and_a_correction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cluster\.placement=split"):
        _config(tmp_path, "algorithm.max_staleness=1", "cluster.placement=colocated")
    with pytest.raises(ValueError, match="rollout_correction"):
        _config(tmp_path, "algorithm.max_staleness=1", "algorithm.rollout_correction=none")
