"""The driver process of a run. ``run_grpo``, ``run_sft`` and ``run_dpo`` read top to bottom:
check the inputs and settle where the workers run (before torch or Ray start), start the
workers (``workers``), open the run folder (``open_run``: resume, config, logger), loop over
the steps, finish. The algorithms' arithmetic lives in ``tandem.algorithms``."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tandem.config import DpoConfig, GrpoConfig, SftConfig, save_resolved
from tandem.config.models import RefitConfig
from tandem.imports import resume_gc
from tandem.logging.console import quiet_console
from tandem.logging.metrics import MetricsLogger, read_metrics
from tandem.logging.plots import plot_run
from tandem.runs import Checkpoints, check_run_dir, make_run_dir, truncate_metrics

if TYPE_CHECKING:
    from tandem.cluster.runtime import Runtime
    from tandem.cluster.spec import RuntimeSpec

AnyConfig = TypeVar("AnyConfig", GrpoConfig, SftConfig, DpoConfig)
log = logging.getLogger(__name__)


def settle_runtime(
    config: AnyConfig, kind: str, resume: bool, **spec: Any
) -> tuple[AnyConfig, RuntimeSpec, Path]:
    """The run's ``RuntimeSpec`` with ``cluster.runtime`` and ``generation.backend`` decided,
    the config that records them (its saved copy names where the workers ran and what
    generated), and the run's folder, checked. Nothing has started yet: a misfit or a folder
    that cannot be used is a user's error, before torch."""
    from tandem.cluster.spec import RuntimeSpec

    parts = (config.cluster, config.policy, config.generation)
    refit = config.refit if isinstance(config, GrpoConfig) else RefitConfig()
    resolved = RuntimeSpec(*parts, refit, **spec).resolve()
    config = config.model_copy(
        update={"cluster": resolved.cluster, "generation": resolved.generation}
    )
    check_run_dir(config, kind, resume)
    return config, resolved, make_run_dir(config.logging, kind, resume)


@contextmanager
def workers(spec: RuntimeSpec, model_path: Path) -> Iterator[tuple[Runtime, Any]]:
    """The started runtime and the model's tokenizer. Ray starts (for Ray actors) while a
    thread imports the runtime (torch) and loads the tokenizer (transformers' import takes
    seconds), which goes on while the actors start. Ray starts in this thread: started from
    another, its processes die with that thread."""
    from tandem.data.prompts import load_tokenizer

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        launch = pool.submit(importlib.import_module, "tandem.cluster.launch")
        tokenizer = pool.submit(load_tokenizer, model_path)
        if spec.cluster.runtime == "ray":
            from tandem.cluster.ray_cluster import init_ray

            init_ray(spec.cluster.address)
        else:  # the workers import transformers in this thread: not while that one does (its
            tokenizer.result()  # lazy module is not safe to import from two threads at once)
        runtime = launch.result().start_runtime(spec)
    except BaseException:
        # a Ctrl-C during the start does not wait for the thread's imports to end
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    with runtime, pool:
        yield runtime, tokenizer.result()


class DriverState(Protocol):
    """What the loop keeps beside the workers' state (async GRPO's pipeline): saved with each
    checkpoint, handed back on resume (``Run.resumed``)."""

    def checkpoint_state(self) -> dict[str, Any]: ...


@dataclass
class Run:
    """An open run folder: where each step's metrics go and when evaluations and checkpoints
    fall due."""

    run_dir: Path
    runtime: Runtime
    logger: MetricsLogger
    checkpoints: Checkpoints
    start_step: int
    num_steps: int
    eval_every: int
    resumed: dict[str, Any] = field(default_factory=dict)
    """The driver state of the checkpoint a resumed run starts from ({} for a fresh run)."""
    compiled_again: bool = False
    """A step after this process's first built ``torch.compile`` graphs (warned once)."""

    def steps(self) -> range:
        """The steps still to run (after the checkpoint of a resumed run)."""
        return range(self.start_step + 1, self.num_steps + 1)

    def evaluates(self, step: int) -> bool:
        """Whether step ``step`` ends with an evaluation (step 0: before training)."""
        if self.eval_every <= 0:
            return False
        if step == 0:
            return self.start_step == 0
        return step % self.eval_every == 0 or step == self.num_steps

    def log(self, step: int, metrics: dict[str, float], state: DriverState | None = None) -> None:
        """The step's metrics to every sink, then its checkpoint if one is due (with
        ``state``'s, when given)."""
        self._warn_compiling(step, metrics)
        self.logger.log(step, metrics)
        if step > 0 and self.checkpoints.due(step, self.num_steps):
            driver_state = {} if state is None else state.checkpoint_state()
            self.checkpoints.save(step, self.runtime, driver_state)

    def _warn_compiling(self, step: int, metrics: dict[str, float]) -> None:
        """Compiled layers build a graph for each form of call when it first comes, most in
        the first step; one that comes later (a micro-batch of one row: torch specialises
        sizes of 1; another grad mode or dtype) is compiled at that step's expense, once: said
        once, with where torch logged why."""
        graphs = metrics.get("compile/graphs", 0.0)
        if graphs > 0 and step > self.start_step + 1 and not self.compiled_again:
            self.compiled_again = True
            log.warning(
                "step %d: policy.compile built %d more graph(s) (%.1f s of compiling) for a form"
                " of call the first step did not have (each is built once); why: %s",
                step,
                graphs,
                metrics.get("compile/seconds", 0.0),
                self.run_dir / "logs" / "console.log",
            )


@contextmanager
def open_run(
    config: GrpoConfig | SftConfig | DpoConfig, run_dir: Path, resume: bool, runtime: Runtime
) -> Iterator[Run]:
    """The run folder with the resolved config in it; on ``resume`` the latest complete
    checkpoint is loaded (and refit into the generators) and later metrics dropped. When the
    block ends without an error, the policy is exported (``checkpoint.export_hf``) and the
    metrics plotted."""
    resume_gc()  # the start is over (``cli.main`` paused the collector for it)
    save_resolved(config, run_dir)
    checkpoints = Checkpoints(run_dir, config.checkpoint)
    start, resumed = 0, dict[str, Any]()
    if resume:
        resumed = checkpoints.load(runtime)
        start = int(resumed["step"])
        truncate_metrics(run_dir, start)
        runtime.refit(version=start)
    num_steps, eval_every = config.algorithm.num_steps, config.algorithm.eval_every
    with MetricsLogger(config.logging, run_dir, num_steps, start_step=start) as logger:
        logger.info(f"run directory: {run_dir}")
        logger.info(f"workers: {runtime.where}")
        runtime.on_phase = logger.phase
        yield Run(run_dir, runtime, logger, checkpoints, start, num_steps, eval_every, resumed)
        if config.checkpoint.export_hf:
            runtime.export_hf(str((run_dir / "hf").resolve()))
            logger.info(f"trained policy (Hugging Face folder): {run_dir / 'hf'}")
    plot_run(read_metrics(run_dir), run_dir / "reward.png", title=run_dir.name)


def run_grpo(config: GrpoConfig, resume: bool = False) -> list[dict[str, Any]]:
    from tandem.cluster.scorers import check_scorers, model_scorers, scorer_kinds
    from tandem.data.prompts import PromptSource, load_prompt_items
    from tandem.preflight import check_episode_length, check_prompt_lengths, check_run_inputs
    from tandem.rewards import RewardScorer

    context = check_run_inputs(config.policy, config.generation, config.data)  # before torch
    check_scorers(config)  # a reward model, a judge, a teacher
    algo, data = config.algorithm, config.data
    config, spec, run_dir = settle_runtime(
        config,
        "grpo",
        resume,
        with_reference=algo.kl_coef > 0,
        total_steps=algo.num_steps * algo.ppo_epochs * algo.num_minibatches,  # optimizer steps
        in_flight_refit=algo.refit_mode == "in_flight",
        num_scorers=len(scorer_kinds(config)),
        scorer_placement=config.reward.placement,
    )
    if config.environment is not None:
        check_episode_length(config.environment.max_tokens, context)
    train, eval_items = load_prompt_items(data, algo.seed, environment=config.environment)
    scorer = RewardScorer(
        data.reward, data.num_reward_workers, data.reward_timeout_s, data.invalid_reward
    )
    with (
        quiet_console(run_dir / "logs" / "console.log", config.logging.verbose),
        scorer,
        workers(spec, config.policy.model_path) as (runtime, tokenizer),
    ):
        from tandem.algorithms.async_grpo import RolloutPipeline
        from tandem.algorithms.grpo import grpo_step

        source = PromptSource(
            train, eval_items, tokenizer, scorer, algo.seed, config.policy.model_path
        )
        check_prompt_lengths(source.longest_prompts(), context, config.generation)
        with (
            open_run(config, run_dir, resume, runtime) as run,
            environments(config) as envs,
            model_scorers(config, getattr(runtime.placement, "scorer_bundles", ())) as scorers,
        ):
            source.environments, source.scorers = envs, scorers
            pipeline = None
            if algo.max_staleness > 0:  # a resumed pipeline trains what its checkpoint holds
                pipeline = RolloutPipeline(runtime, config, source, run.resumed)
            if run.evaluates(0):
                evaluation = grpo_evaluation(runtime, source, config, pipeline)
                run.log(0, evaluation | runtime.take_metrics())
            for step in run.steps():
                if pipeline is not None:
                    metrics = pipeline.step(step)
                else:
                    prompts = source.train_prompts(step - 1, algo.prompts_per_step)
                    metrics = grpo_step(runtime, config, prompts, step, source).metrics
                if run.evaluates(step):
                    metrics.update(grpo_evaluation(runtime, source, config, pipeline))
                # what the memory phases cost (colocated GPUs), the generators' idle time and
                # decode figures: this step's, its evaluation's included
                metrics.update(runtime.take_metrics())
                run.log(step, metrics, pipeline)
    return read_metrics(run_dir)


def grpo_evaluation(
    runtime: Runtime, source: Any, config: GrpoConfig, pipeline: Any
) -> dict[str, float]:
    """Held-out accuracy of the policy just trained (an async pipeline refits it first)."""
    from tandem.algorithms.grpo import evaluate

    if pipeline is not None:
        pipeline.sync_weights()
    sampling = config.generation.sampling
    return evaluate(runtime, source, config.data.num_eval_prompts, sampling, config)


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


def run_sft(config: SftConfig, resume: bool = False) -> list[dict[str, Any]]:
    """SFT; held-out accuracy is measured by refitting a generator before each evaluation."""
    from tandem.algorithms.sft import sft_step
    from tandem.data.prompts import PromptSource, load_prompt_items
    from tandem.preflight import check_prompt_lengths, check_run_inputs
    from tandem.rewards import RewardScorer

    context = check_run_inputs(config.policy, config.generation, config.data)  # before torch
    algo, data = config.algorithm, config.data
    config, spec, run_dir = settle_runtime(config, "sft", resume, total_steps=algo.num_steps)
    train, eval_items = load_prompt_items(data, algo.seed)
    scorer = RewardScorer(
        data.reward, data.num_reward_workers, data.reward_timeout_s, data.invalid_reward
    )
    with (
        quiet_console(run_dir / "logs" / "console.log", config.logging.verbose),
        scorer,
        workers(spec, config.policy.model_path) as (runtime, tokenizer),
    ):
        source = PromptSource(
            train, eval_items, tokenizer, scorer, algo.seed, config.policy.model_path
        )
        check_prompt_lengths(source.longest_prompts(), context, config.generation)
        with open_run(config, run_dir, resume, runtime) as run:
            if run.evaluates(0):
                run.log(0, sft_evaluation(runtime, source, config))
            for step in run.steps():
                metrics = sft_step(runtime, source, step, algo.batch_size)
                if run.evaluates(step):
                    metrics.update(sft_evaluation(runtime, source, config))
                run.log(step, metrics)
        if config.output_dir is not None:
            runtime.export_hf(str(config.output_dir.resolve()))
    return read_metrics(run_dir)


def sft_evaluation(runtime: Runtime, source: Any, config: SftConfig) -> dict[str, float]:
    """Held-out accuracy of the policy just trained, refitted into the generator."""
    from tandem.algorithms.grpo import evaluate

    runtime.refit()
    sampling = config.generation.sampling
    return evaluate(runtime, source, config.data.num_eval_prompts, sampling)


def run_dpo(config: DpoConfig, resume: bool = False) -> list[dict[str, Any]]:
    """DPO / IPO on preference pairs against a frozen reference (the starting policy). Each
    evaluation scores the held-out pairs and, on the arithmetic task, refits a generator and
    measures greedy accuracy on the held-out prompts."""
    from tandem.algorithms.dpo import dpo_step
    from tandem.data.preferences import load_pairs
    from tandem.data.prompts import PromptSource
    from tandem.preflight import check_run_inputs
    from tandem.rewards import load_reward

    check_run_inputs(config.policy, config.generation, config.data)  # before torch
    algo = config.algorithm
    train, eval_pairs, eval_prompts = load_pairs(config.data, algo.seed)
    config, spec, run_dir = settle_runtime(
        config,
        "dpo",
        resume,
        with_reference=True,
        with_generators=bool(eval_prompts),
        total_steps=algo.num_steps,
    )
    with (
        quiet_console(run_dir / "logs" / "console.log", config.logging.verbose),
        workers(spec, config.policy.model_path) as (runtime, tokenizer),
    ):
        exact_match = load_reward("exact_match")
        pairs = PromptSource(train, eval_pairs, tokenizer, exact_match, algo.seed)
        prompts = PromptSource(train, eval_prompts, tokenizer, exact_match, algo.seed)
        with open_run(config, run_dir, resume, runtime) as run:
            if run.evaluates(0):
                run.log(0, dpo_evaluation(runtime, pairs, prompts, config))
            for step in run.steps():
                metrics = dpo_step(runtime, pairs, step, config.algorithm)
                if run.evaluates(step):
                    metrics.update(dpo_evaluation(runtime, pairs, prompts, config))
                run.log(step, metrics)
        if config.output_dir is not None:
            runtime.export_hf(str(config.output_dir.resolve()))
    return read_metrics(run_dir)


def dpo_evaluation(
    runtime: Runtime, pairs: Any, prompts: Any, config: DpoConfig
) -> dict[str, float]:
    """The held-out pairs' loss and preference accuracy; where there are held-out prompts, the
    greedy accuracy of the policy just trained, refitted into the generator."""
    from tandem.algorithms.dpo import score_pairs, summary
    from tandem.algorithms.grpo import evaluate

    metrics: dict[str, float] = {}
    if pairs.eval_items:
        _, stats = score_pairs(runtime, pairs, pairs.eval_items, config.algorithm)
        metrics.update(summary(stats, config.algorithm.beta, "eval"))
    if prompts.eval_items:
        runtime.refit()
        sampling = config.generation.sampling
        metrics.update(evaluate(runtime, prompts, len(prompts.eval_items), sampling))
    return metrics
