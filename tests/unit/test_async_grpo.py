"""Async GRPO's rollout pipeline with the real workers in this process (``LocalGroup``: the
generator works in its own thread while the trainer trains): the staleness bound, when it refits,
the versions on rollouts, the fixed-lag schedule (the same versions whichever side is slow, the
same metrics twice), and the prompt accounting and exact replay across a restart."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _runtime(config: GrpoConfig, max_concurrency: int = 1) -> Runtime:
    trainer = TrainerWorker(
        policy=config.policy,
        refit=config.refit.model_copy(update={"transport": "colocated"}),
        generation=config.generation,
    )
    generator = GeneratorWorker(
        generation=config.generation,
        model_path=str(DEFAULT_MODEL_DIR),
        compute_thread=max_concurrency > 1,  # as launch_ray builds them for in-flight refit
    )
    generators = LocalGroup([generator], "generator", max_concurrency=max_concurrency)
    return Runtime(LocalGroup([trainer], "trainer"), generators)


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


def test_in_flight_refits_land_in_the_running_generation(tmp_path: Path) -> None:
    """refit_mode=in_flight: the refit after step s goes into the generation of step s + 1
    while it runs (each generation here holds its second decode step until a refit waits at
    the gate, or 1.5 s): its first tokens come from version s - 1, the rest from version s."""
    config = _config(tmp_path, "algorithm.max_staleness=1", "algorithm.refit_mode=in_flight")
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    with _runtime(config, max_concurrency=2) as runtime:
        generator = runtime.generators.workers[0].generator  # type: ignore[union-attr]
        sample = generator._sample

        def held_sample(logits, keys, step, params):  # type: ignore[no-untyped-def]
            if step == 1:  # the refit, if one comes, lands before step 2
                deadline = time.monotonic() + 1.5
                while generator.gate.waiting_updates == 0 and time.monotonic() < deadline:
                    time.sleep(0.005)
            return sample(logits, keys, step, params)

        generator._sample = held_sample
        rollouts: list[list] = []  # each generation's, in order
        collect = runtime.collect
        runtime.collect = lambda pending: rollouts.append(collect(pending)) or rollouts[-1]  # type: ignore[method-assign]
        pipeline = RolloutPipeline(runtime, config, source)
        records = [pipeline.step(step) for step in range(1, 6)]
    assert [r["async/refit"] for r in records] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0, 1.0, 1.0]
    fractions = [r["async/in_flight_token_frac"] for r in records]
    assert fractions[0] == 0.0 and fractions[4] == 0.0  # no refit while they generated
    assert all(f > 0 for f in fractions[1:4]), fractions
    for step, batch in enumerate(rollouts, start=1):
        for r in batch:
            n = len(r.response_token_ids)
            assert r.policy_version == max(step - 2, 0)
            mixed = [r.policy_version] * min(2, n) + [step - 1] * max(n - 2, 0)
            assert r.response_versions == (mixed if 2 <= step <= 4 else [r.policy_version] * n)
    assert all("rollout_correction/truncated_frac" in r for r in records)


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


STEPS = 6


def _stable(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """Every metric but the clocks' (seconds, rates) and the reward scorer's seconds."""
    unstable = ("timing/", "throughput/", "refit/gb_per_s", "reward/score_s")
    return [{k: v for k, v in r.items() if not k.startswith(unstable)} for r in records]


def _slowed(method: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return method(*args, **kwargs)

    return slow


def _run(
    config: GrpoConfig, steps: range, slow: str = "", resumed: dict[str, Any] | None = None
) -> tuple[list[dict[str, float]], list[list[Any]]]:
    """The pipeline's metrics over ``steps`` and each generation's rollouts, in order; ``slow``:
    the trainer or the generator sleeps 0.4 s in each of its calls."""
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    generations: list[list[Any]] = []
    with _runtime(config) as runtime:
        trainer = runtime.trainers.workers[0]  # type: ignore[attr-defined]
        generator = runtime.generators.workers[0]  # type: ignore[union-attr]
        if slow == "trainer":
            trainer.train = _slowed(trainer.train, 0.4)
        if slow == "generator":
            generator.generate_timed = _slowed(generator.generate_timed, 0.4)
        collect = runtime.collect

        def recorded(pending: Any) -> list[Any]:
            generations.append(collect(pending))
            return generations[-1]

        runtime.collect = recorded  # type: ignore[method-assign]
        pipeline = RolloutPipeline(runtime, config, source, resumed)
        records = [pipeline.step(step) for step in steps]
    return records, generations


@pytest.mark.parametrize("slow", ["trainer", "generator"])
def test_fixed_lag_generates_each_step_from_exactly_k_versions_behind(
    tmp_path: Path, slow: str
) -> None:
    """Conformance: whichever side is slow, step t's rollouts come from version max(0, t-1-k)
    (never fresher, never staler); the free schedule under the same load stays within k but
    trains fresher rollouts (it refits only when the bound forces it)."""
    k = 2
    lagged = (f"algorithm.max_staleness={k}", f"algorithm.num_steps={STEPS}")
    fixed = _config(tmp_path, *lagged, "algorithm.async_schedule=fixed_lag")
    records, generations = _run(fixed, range(1, STEPS + 1), slow)
    lag = [min(k, t - 1) for t in range(1, STEPS + 1)]
    assert [r["async/staleness"] for r in records] == lag
    assert [r["async/staleness_mean"] for r in records] == lag
    # each generation's rollouts all come from the one version its step is due from
    versions = sorted({r.policy_version for r in g} for g in generations)
    assert versions == [{max(0, t - 1 - k)} for t in range(1, STEPS + 1)]
    # a refit after each step a later step is due from (t + 1 + k <= STEPS), none after
    assert [r["async/refit"] for r in records] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert [r[f"async/staleness_count_{s}"] for s in range(k + 1) for r in records[-1:]] == [
        16.0,
        16.0,
        64.0,
    ]
    free = _config(tmp_path, *lagged, "algorithm.async_schedule=free")
    free_records, _ = _run(free, range(1, STEPS + 1), slow)
    free_lag = [r["async/staleness"] for r in free_records]
    assert all(s <= k for s in free_lag) and sum(free_lag) < sum(lag), free_lag


def test_two_fixed_lag_runs_give_the_same_metrics(tmp_path: Path) -> None:
    """With per-prompt seeds, what each step trains is a function of its prompts, its seed and
    its version: the same config twice gives the same metrics, one of them slowed."""
    config = _config(tmp_path, "algorithm.max_staleness=2", "algorithm.async_schedule=fixed_lag")
    first, _ = _run(config, range(1, 6))
    second, _ = _run(config, range(1, 6), slow="trainer")
    assert _stable(first) == _stable(second)
    assert len({r["train/loss"] for r in first}) == 5  # the steps differ from each other


def test_a_fixed_lag_pipeline_resumes_bit_for_bit(tmp_path: Path) -> None:
    """A checkpoint after step 2 (the trainer's and the pipeline's state, through JSON); the
    resumed pipeline trains steps 3-5 exactly as the uninterrupted one, though the weights that
    generated step 3's rollouts (version 1, k = 1) are gone by then."""
    config = _config(tmp_path, "algorithm.max_staleness=1", "algorithm.async_schedule=fixed_lag")
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    checkpoint = tmp_path / "step_2"
    with _runtime(config) as runtime:
        straight = RolloutPipeline(runtime, config, source)
        records = [straight.step(step) for step in (1, 2)]
        state = json.loads(json.dumps({"step": 2, **straight.checkpoint_state()}))
        runtime.save_checkpoint(str(checkpoint))
        records += [straight.step(step) for step in (3, 4, 5)]
    assert [b["step"] for b in state["pipeline"]["batches"]] == [3, 4]
    assert {r["policy_version"] for r in state["pipeline"]["batches"][0]["rollouts"]} == {1}
    with _runtime(config) as runtime:
        runtime.load_checkpoint(str(checkpoint))
        runtime.refit(version=2)  # as the driver's open_run does
        resumed = RolloutPipeline(runtime, config, source, state)
        again = [resumed.step(step) for step in (3, 4, 5)]
    assert _stable(again) == _stable(records[2:])


def test_a_fixed_lag_pipeline_without_state_counts_the_lag_from_its_weights(
    tmp_path: Path,
) -> None:
    """Started at step 3 without a checkpoint's pipeline state (the weights of versions 0 and 1
    that steps 3 and 4 are due from exist nowhere), the pipeline counts the lag from the weights
    it holds, version 2, as a run from the start counts it from version 0."""
    config = _config(tmp_path, "algorithm.max_staleness=1", "algorithm.async_schedule=fixed_lag")
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    with _runtime(config) as runtime:
        runtime.refit(version=2)
        pipeline = RolloutPipeline(runtime, config, source)
        records = [pipeline.step(step) for step in (3, 4, 5)]
    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 1.0]
    assert [r["data/prompt_digest"] for r in records] == [_digest(source, s) for s in (3, 4, 5)]


def test_a_finished_fixed_lag_run_given_more_steps_counts_the_lag_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """The checkpoint of the last step planned no rollouts for later steps; resumed with more
    steps, the lag restarts from the checkpoint's weights (staleness 0, then k)."""
    config = _config(tmp_path, "algorithm.max_staleness=1", "algorithm.async_schedule=fixed_lag")
    longer = _config(tmp_path, "algorithm.max_staleness=1", "algorithm.async_schedule=fixed_lag")
    longer.algorithm.num_steps = 7
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    with _runtime(config) as runtime:
        first = RolloutPipeline(runtime, config, source)
        [first.step(step) for step in range(1, 6)]
        state = {"step": 5, **first.checkpoint_state()}
        assert state["pipeline"]["batches"] == []
        runtime.refit(version=5)
        resumed = RolloutPipeline(runtime, longer, source, state)
        records = [resumed.step(step) for step in (6, 7)]
    assert [r["async/staleness"] for r in records] == [0.0, 1.0]
    assert records[-1]["async/staleness_count_1"] == 16 * 5


def test_max_staleness_needs_split_placement_and_a_correction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cluster\.placement=split"):
        _config(tmp_path, "algorithm.max_staleness=1", "cluster.placement=colocated")
    with pytest.raises(ValueError, match="rollout_correction"):
        _config(tmp_path, "algorithm.max_staleness=1", "algorithm.rollout_correction=none")
    with pytest.raises(ValueError, match=r"refit_mode=in_flight needs algorithm\.max_staleness"):
        _config(tmp_path, "algorithm.refit_mode=in_flight")
    with pytest.raises(ValueError, match="after_requests"):
        _config(tmp_path, "algorithm.max_staleness=1", "algorithm.refit_mode=sometimes")
    with pytest.raises(ValueError, match="after_requests with async_schedule=fixed_lag"):
        fixed = ("algorithm.max_staleness=1", "algorithm.async_schedule=fixed_lag")
        _config(tmp_path, *fixed, "algorithm.refit_mode=in_flight")


def test_a_two_call_generator_builds_and_generates_on_one_thread_of_its_own(
    tmp_path: Path,
) -> None:
    """``compute_thread``: whichever thread calls, the engine is built and every generation
    runs on the worker's one compute thread (OpenMP work on two threads slows both)."""
    import threading

    from tandem.generation.base import SamplingParams

    config = _config(tmp_path)
    worker = GeneratorWorker(
        generation=config.generation, model_path=str(DEFAULT_MODEL_DIR), compute_thread=True
    )
    seen: list[int] = []
    generate = worker.generator.generate

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(threading.get_ident())
        return generate(*args, **kwargs)

    worker.generator.generate = recorded  # type: ignore[method-assign]
    params = SamplingParams(temperature=1.0, max_tokens=4, n=2, seed=0)
    callers = [threading.Thread(target=worker.generate, args=([[1, 2, 3]], params)) for _ in "ab"]
    for caller in callers:
        caller.start()
        caller.join()
    worker.generate([[1, 2, 3]], params)  # and from this thread
    assert len(seen) == 3 and len(set(seen)) == 1
    assert seen[0] not in {threading.get_ident(), *(c.ident for c in callers)}
    worker.shutdown()
