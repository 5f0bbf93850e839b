"""The driver process of a run: run directory, worker runtime, the step loop, evaluation,
checkpoints and resume. The algorithms' arithmetic lives in ``tandem.algorithms``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from tandem.config import DpoConfig, GrpoConfig, SftConfig, save_resolved
from tandem.imports import resume_gc
from tandem.logging.metrics import MetricsLogger, read_metrics
from tandem.logging.plots import plot_run
from tandem.runs import Checkpoints, check_run_dir, make_run_dir, truncate_metrics


def run_loop(
    config: GrpoConfig | SftConfig | DpoConfig,
    kind: str,
    runtime: Any,
    num_steps: int,
    eval_every: int,
    step_fn: Callable[[int], dict[str, float]],
    eval_fn: Callable[[], dict[str, float]],
    resume: bool,
) -> list[dict[str, Any]]:
    """The step loop shared by every algorithm: evaluation, logging, checkpoints, resume."""
    resume_gc()  # the start is over (``cli.main`` paused the collector for it)
    run_dir = make_run_dir(config.logging, kind, resume)
    save_resolved(config, run_dir)
    checkpoints = Checkpoints(run_dir, config.checkpoint)
    start = 0
    if resume:
        start = int(checkpoints.load(runtime)["step"])
        truncate_metrics(run_dir, start)
        runtime.refit(version=start)
    with MetricsLogger(config.logging, run_dir, num_steps, start_step=start) as logger:
        logger.info(f"run directory: {run_dir}")
        if runtime is not None:  # None: a loop of steps that need no workers
            logger.info(f"workers: {runtime.where}")
        if start == 0 and eval_every > 0:
            logger.log(0, eval_fn())
        for step in range(start + 1, num_steps + 1):
            metrics = step_fn(step)
            if eval_every > 0 and (step % eval_every == 0 or step == num_steps):
                metrics.update(eval_fn())
            logger.log(step, metrics)
            if checkpoints.due(step, num_steps):
                checkpoints.save(step, runtime, {})
        if config.checkpoint.export_hf:
            runtime.export_hf(str((run_dir / "hf").resolve()))
            logger.info(f"trained policy (Hugging Face folder): {run_dir / 'hf'}")
    records = read_metrics(run_dir)
    plot_run(records, run_dir / "reward.png", title=f"{kind}: {run_dir.name}")
    return records


def run_grpo(config: GrpoConfig, resume: bool = False) -> list[dict[str, Any]]:
    from tandem.preflight import check_episode_length, check_run_inputs

    context = check_run_inputs(config.policy, config.generation, config.data)  # before torch
    check_run_dir(config, "grpo", resume)
    from tandem.cluster.spec import RuntimeSpec

    algo = config.algorithm
    spec = RuntimeSpec(
        config.cluster,
        config.policy,
        config.generation,
        config.refit,
        with_reference=algo.kl_coef > 0,
        total_steps=algo.num_steps * algo.ppo_epochs * algo.num_minibatches,  # optimizer steps
        in_flight_refit=algo.refit_mode == "in_flight",
    )
    if config.environment is not None:
        check_episode_length(config.environment.max_tokens, context)
    with (
        runtime_and_prompts(config, spec, context) as (runtime, source),
        environments(config) as envs,
    ):
        from tandem.algorithms.async_grpo import RolloutPipeline
        from tandem.algorithms.grpo import evaluate, grpo_step

        source.environments = envs

        def step_fn(step: int) -> dict[str, float]:
            if pipeline is not None:
                metrics = pipeline.step(step)
            else:
                prompts = source.train_prompts(step - 1, algo.prompts_per_step)
                metrics = grpo_step(runtime, config, prompts, step, source).metrics
            # what the memory phases cost (colocated GPUs), the generators' idle time
            return {**metrics, **runtime.take_metrics()}

        def eval_fn() -> dict[str, float]:
            if pipeline is not None:
                pipeline.sync_weights()  # evaluate the policy just trained
            sampling = config.generation.sampling
            return evaluate(runtime, source, config.data.num_eval_prompts, sampling, config)

        pipeline = RolloutPipeline(runtime, config, source) if algo.max_staleness > 0 else None
        return run_loop(
            config, "grpo", runtime, algo.num_steps, algo.eval_every, step_fn, eval_fn, resume
        )


@contextmanager
def environments(config: GrpoConfig) -> Iterator[Any]:
    """The environment actors of a multi-turn run (None without an environment section)."""
    env = config.environment
    if env is None:
        yield None
        return
    from tandem.cluster.env_pool import EnvironmentPool
    from tandem.cluster.ray_cluster import init_ray

    init_ray(config.cluster.address)  # started already unless the runtime is in this process
    pool = EnvironmentPool(
        env.name,
        env.kwargs,
        num_workers=env.num_workers,
        step_timeout_s=env.step_timeout_s,
        kind=env.actor_kind,
        env_mode=config.cluster.env_mode,
        max_concurrency=env.episodes_per_worker,
        num_cpus=env.cpus_per_worker,
    )
    try:
        yield pool
    finally:
        pool.shutdown()


@contextmanager
def runtime_and_prompts(
    config: GrpoConfig | SftConfig, spec: Any, context: int
) -> Iterator[tuple[Any, Any]]:
    """The started runtime and the prompt source (``preflight.check_run_inputs`` has checked
    the inputs and found the model's ``context``). The prompts are read (and checked) before
    anything starts. Then Ray starts while a thread imports the runtime (torch: 1.1-1.3 s) and
    loads the tokenizer (transformers' import takes seconds), which goes on while the actors
    start. Ray starts in this thread: started from another, its processes die with that thread.
    Before here the driver imports nothing that imports torch."""
    from tandem.data.prompts import PromptSource, load_prompt_items, load_tokenizer
    from tandem.preflight import check_prompt_lengths
    from tandem.rewards import RewardScorer

    seed, data = config.algorithm.seed, config.data
    scorer = RewardScorer(
        data.reward, data.num_reward_workers, data.reward_timeout_s, data.invalid_reward
    )
    environment = config.environment if isinstance(config, GrpoConfig) else None
    train, eval_items = load_prompt_items(data, seed, environment=environment)
    with scorer, ThreadPoolExecutor(max_workers=1) as pool:
        runtime_module = pool.submit(importlib.import_module, "tandem.cluster.runtime")
        tokenizer = pool.submit(load_tokenizer, config.policy.model_path)
        if spec.cluster.in_process:
            # the workers import transformers here: not while that thread does (its lazy
            # module is not safe to import from two threads at once)
            tokenizer.result()
        else:
            from tandem.cluster.ray_cluster import init_ray

            init_ray(spec.cluster.address)
        with runtime_module.result().Runtime.start(spec) as runtime:
            source = PromptSource(train, eval_items, tokenizer.result(), scorer, seed)
            check_prompt_lengths(source.longest_prompts(), context, config.generation)
            yield runtime, source


def run_sft(config: SftConfig, resume: bool = False) -> list[dict[str, Any]]:
    """SFT; held-out accuracy is measured by refitting a generator before each evaluation."""
    from tandem.preflight import check_run_inputs

    context = check_run_inputs(config.policy, config.generation, config.data)  # before torch
    check_run_dir(config, "sft", resume)
    from tandem.cluster.spec import RuntimeSpec
    from tandem.config.models import RefitConfig

    algo = config.algorithm
    sampling = config.generation.sampling
    spec = RuntimeSpec(
        config.cluster, config.policy, config.generation, RefitConfig(), total_steps=algo.num_steps
    )
    with runtime_and_prompts(config, spec, context) as (runtime, source):
        from tandem.algorithms.grpo import evaluate
        from tandem.algorithms.sft import sft_step

        def eval_fn() -> dict[str, float]:
            runtime.refit()
            return evaluate(runtime, source, config.data.num_eval_prompts, sampling)

        records = run_loop(
            config,
            "sft",
            runtime,
            algo.num_steps,
            algo.eval_every,
            lambda step: sft_step(runtime, source, step, algo.batch_size),
            eval_fn,
            resume,
        )
        if config.output_dir is not None:
            runtime.export_hf(str(config.output_dir.resolve()))
    return records


def run_dpo(config: DpoConfig, resume: bool = False) -> list[dict[str, Any]]:
    """DPO / IPO on preference pairs against a frozen reference (the starting policy). Each
    evaluation scores the held-out pairs and, on the arithmetic task, refits a generator and
    measures greedy accuracy on the held-out prompts."""
    from tandem.preflight import check_run_inputs

    check_run_inputs(config.policy, config.generation, config.data)  # before torch
    check_run_dir(config, "dpo", resume)
    from tandem.algorithms.dpo import dpo_step, score_pairs, summary
    from tandem.algorithms.grpo import evaluate
    from tandem.cluster.runtime import Runtime, RuntimeSpec
    from tandem.config.models import RefitConfig
    from tandem.data.preferences import load_pairs
    from tandem.data.prompts import PromptSource, load_tokenizer
    from tandem.rewards import load_reward

    algo, data = config.algorithm, config.data
    train, eval_pairs, eval_prompts = load_pairs(data, algo.seed)
    spec = RuntimeSpec(
        config.cluster,
        config.policy,
        config.generation,
        RefitConfig(),
        with_reference=True,
        with_generators=bool(eval_prompts),
        total_steps=algo.num_steps,
    )

    def eval_fn() -> dict[str, float]:
        metrics = {}
        if eval_pairs:
            _, stats = score_pairs(runtime, pairs, eval_pairs, algo)
            metrics.update(summary(stats, algo.beta, "eval"))
        if eval_prompts:
            runtime.refit()
            sampling = config.generation.sampling
            metrics.update(evaluate(runtime, prompts, len(eval_prompts), sampling))
        return metrics

    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer = pool.submit(load_tokenizer, config.policy.model_path)
        if spec.cluster.in_process:
            tokenizer.result()  # not while the workers import transformers here
        with Runtime.start(spec) as runtime:
            exact_match = load_reward("exact_match")
            pairs = PromptSource(train, eval_pairs, tokenizer.result(), exact_match, algo.seed)
            prompts = PromptSource(train, eval_prompts, pairs.tokenizer, exact_match, algo.seed)
            records = run_loop(
                config,
                "dpo",
                runtime,
                algo.num_steps,
                algo.eval_every,
                lambda step: dpo_step(runtime, pairs, step, algo),
                eval_fn,
                resume,
            )
            if config.output_dir is not None:
                runtime.export_hf(str(config.output_dir.resolve()))
    return records
