"""The RL runtime: trainer and generator worker groups, and the calls the algorithm makes on them
(``algorithms.protocols.RolloutRuntime``). Placement, the memory phases of colocated GPUs and the
refit transport are handled here, so the algorithm never branches on them.

Memory phases. On colocated GPUs trainers and generators share each device and take turns. Every
call states what it needs and ``_enter`` makes it so, releasing before acquiring (offload and
sleep first, then onload and wake), so no call can meet an offloaded trainer or an engine that
holds memory the trainer needs, whatever order the algorithm calls them in:

    call                      policy    reference   generators
    generate                  host      host        awake (weights current: refit first if not)
    policy_logprobs, train    device    host        asleep
    reference_logprobs        -         device      asleep
    refit                     device    host        weights only (the KV cache wakes at generate)
    checkpoints, export       device    -           asleep

(``-``: left as it is.) Waking the weights before the KV cache is the staged wake-up that keeps
the refit's peak at trainer state + generator weights + buckets. Off colocated GPUs nothing moves
and ``_enter`` returns at once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from tandem.cluster.groups import Group, WorkerError, get_together
from tandem.cluster.spec import RuntimeSpec
from tandem.config.models import ClusterConfig, GenerationConfig, generator_dtype
from tandem.data.batch import TrainBatch

if TYPE_CHECKING:
    from tandem.algorithms.protocols import LossFn
    from tandem.cluster.placement import Placement
    from tandem.generation.base import Rollout, SamplingParams

logger = logging.getLogger(__name__)

GeneratorPhase = Literal["asleep", "weights", "awake"]
"""asleep: no device memory; weights: weights resident, no KV cache; awake: ready to generate."""


def start_groups(makers: Mapping[str, Callable[[], Group]], parallel: bool) -> dict[str, Group]:
    """Build each worker group (``makers``: kind -> constructor), all at once when ``parallel``.
    If one fails, the groups that started are shut down and the first failure (in ``makers``'
    order) is raised."""
    if not parallel:
        started: dict[str, Group] = {}
        try:
            for kind, make in makers.items():
                started[kind] = make()
        except BaseException:
            for group in started.values():
                group.shutdown()
            raise
        return started
    with ThreadPoolExecutor(max_workers=len(makers)) as pool:
        futures = {kind: pool.submit(make) for kind, make in makers.items()}
    errors = [f.exception() for f in futures.values() if f.exception() is not None]
    if errors:
        for future in futures.values():
            if future.exception() is None:
                future.result().shutdown()
        raise errors[0]  # type: ignore[misc]
    return {kind: future.result() for kind, future in futures.items()}


KEEP_FREED_HOST_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
"""glibc malloc settings of the actors on CPU machines: every allocation from the heap (none
mmapped) and nothing trimmed back, so what a step frees the next one reuses, instead of
unmapping it and faulting it in again page by page, zeroed. On the long CPU workload the
trainer actor took 2.0M -> 0.85M minor faults over 4 steps, 8.0-8.5 -> 4.7-5.2 s of system
time, training steps 4.0-5.9 -> 3.5-5.0 s, the same peak RSS (3.0-3.2 GB). glibc reads them
at a process's start; the in-process runtime sets the same through ``mallopt``
(``in_process.keep_freed_host_memory``)."""


def _actor_env(cluster: ClusterConfig, placement: Placement) -> dict[str, str]:
    """The environment variables of every trainer and generator actor."""
    from tandem.cluster.placement import actor_threads

    # no progress bars from the actors (transformers' "Loading weights", one per actor): Ray's
    # log monitor forwards a bar's line once it ends, so they reached the terminal late, some
    # after the run's last step; the driver shows the run's own progress
    env = {"OMP_NUM_THREADS": str(actor_threads(cluster)), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if not any(s.num_gpus for s in [*placement.trainer_bundles, *placement.generator_bundles]):
        env.update(KEEP_FREED_HOST_MEMORY)
    return env


def resolved_generation(spec: RuntimeSpec) -> GenerationConfig:
    """``spec.generation`` with its dtype resolved: the generators compute in the trainer's
    compute dtype unless told otherwise."""
    return spec.generation.model_copy(
        update={"dtype": generator_dtype(spec.policy, spec.generation)}
    )


@dataclass
class _Phase:
    """Where each side is now (the driver's record; the workers' moves are idempotent)."""

    policy: bool = True
    """The policy's state is on the device."""
    reference: bool = True
    generators: GeneratorPhase = "awake"
    weights_current: bool = True
    """The generators hold the trainer's latest weights (a deep sleep discards them)."""


class Runtime:
    """Worker groups of one run. ``close()`` (or a ``with`` block) shuts them down.

    ``Runtime.start(spec)`` places Ray actors; ``Runtime(trainers, generators, ...)`` takes any
    ``Group``, e.g. ``LocalGroup`` of plain workers in this process. ``memory_phases`` turns on
    the colocated-GPU phases (module docstring); ``discards_weights``: a generator's sleep drops
    its weights (a refit must follow before it generates again)."""

    def __init__(
        self,
        trainers: Group,
        generators: Group | None = None,
        memory_phases: bool = False,
        discards_weights: bool = False,
        with_reference: bool = False,
        on_close: Callable[[], None] | None = None,
        engine_shutdown: bool = True,
    ):
        self.trainers, self.generators = trainers, generators
        self.engine_shutdown = engine_shutdown
        """``close()`` shuts the generators' engines down before the groups (off where killing
        a worker ends its engine with it)."""
        self.memory_phases = memory_phases
        self.discards_weights = discards_weights
        self.with_reference = with_reference
        self._on_close = on_close
        self._phase = _Phase()
        self._metrics: dict[str, float] = {}
        self.placement: Placement | None = None
        """The Ray placement group of a started runtime (None in-process)."""
        self.weights_version = 0
        """The label of the generators' weights: the ``version`` of the last refit."""
        self._loading: Any = None
        """The generators' pending side of a refit that did not wait for it."""
        self._loading_lock = threading.Lock()  # collect may run in another thread

    @classmethod
    def start(cls, spec: RuntimeSpec) -> Runtime:
        """Start (or join) Ray, place the actors as ``spec.cluster`` says and build them; with
        ``cluster.in_process`` build the workers in this process instead (``in_process``)."""
        if spec.cluster.in_process:
            from tandem.cluster.in_process import InProcessRuntime

            return InProcessRuntime.start(spec)
        return cls._start_actors(spec)

    @classmethod
    def _start_actors(cls, spec: RuntimeSpec) -> Runtime:
        from tandem.cluster.actors import GeneratorWorker, TrainerWorker
        from tandem.cluster.placement import make_placement
        from tandem.cluster.ray_cluster import init_ray
        from tandem.cluster.worker_group import WorkerGroup

        cluster = spec.cluster
        generation = resolved_generation(spec)
        init_ray(address=cluster.address)
        refit = spec.refit
        if refit.transport == "auto":
            refit = refit.model_copy(update={"transport": cluster.placement})
        placement = make_placement(cluster)
        colocated_gpus = cluster.placement == "colocated" and any(
            slot.num_gpus > 0 for slot in placement.trainer_bundles
        )
        group = functools.partial(  # what every group of actors shares
            WorkerGroup,
            env_vars=_actor_env(cluster, placement),
            env_mode=cluster.env_mode,
            call_timeout_s=cluster.call_timeout_s,
        )
        groups = {
            "trainer": lambda: group(
                TrainerWorker,
                cluster.num_trainers,
                kind="trainer",
                kwargs=dict(
                    policy=spec.policy,
                    refit=refit,
                    generation=generation,
                    with_reference=spec.with_reference,
                    num_receivers=cluster.num_generators * spec.generation.tensor_parallel_size,
                    total_steps=spec.total_steps,
                ),
                bundles=placement.trainer_bundles,
            ),
        }
        if spec.with_generators:
            groups["generator"] = lambda: group(
                GeneratorWorker,
                cluster.num_generators,
                kind="generator",
                kwargs=dict(
                    generation=generation,
                    model_path=str(spec.policy.model_path),
                    # two calls at once run on two threads: the engine's work stays on one
                    compute_thread=spec.in_flight_refit,
                ),
                bundles=placement.generator_bundles,
                max_concurrency=2 if spec.in_flight_refit else 1,
            )
        # Both kinds start at once (their processes, imports and model loads overlap), except
        # colocated on GPUs: vLLM sizes its KV cache from the memory it finds free at start.
        try:
            started = start_groups(groups, parallel=not colocated_gpus)
        except BaseException:
            placement.remove()
            raise
        trainers, generators = started["trainer"], started.get("generator")
        runtime = cls(
            trainers,
            generators,
            memory_phases=colocated_gpus,
            discards_weights=spec.generation.sleep_level == 2,
            with_reference=spec.with_reference,
            on_close=placement.remove,
            # Killing an actor ends a CPU engine that runs in its process; vLLM's own shutdown
            # of one spends ~1 s in two gc.collect()s over its heap. Kept where the engine has
            # worker processes of its own (tensor-parallel), and on GPUs, where it frees the
            # device memory before close() returns (a kill frees it some time later).
            engine_shutdown=spec.generation.tensor_parallel_size > 1
            or any(slot.num_gpus > 0 for slot in placement.generator_bundles),
        )
        runtime.placement = placement
        # an FP8 engine starts from dummy weights: the first generation refits first
        runtime._phase.weights_current = spec.generation.precision != "fp8"
        if runtime.memory_phases:  # pinned while the generators load and first generate
            trainers.run("pin_offload_memory")
        return runtime

    @property
    def where(self) -> str:
        """Where the workers run, for the run's log."""
        if self.placement is None:
            return "in this process"
        return f"Ray actors, {self.placement.mode}"

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engines down, then the workers, then free the placement. A worker that
        died (or whose shutdown fails) does not keep the others and the bundles held."""
        try:
            if self.generators is not None:
                if self.engine_shutdown:
                    try:
                        self.generators.run("shutdown")
                    except WorkerError as err:
                        # killing the actor below ends its engine with its process anyway
                        logger.warning("generator shutdown failed; killing the actors: %s", err)
                self.generators.shutdown()
        finally:
            try:
                self.trainers.shutdown()
            finally:
                if self._on_close is not None:
                    self._on_close()

    # -- memory phases ------------------------------------------------------------------------
    def _enter(
        self,
        policy: bool | None = None,
        reference: bool | None = None,
        generators: GeneratorPhase | None = None,
    ) -> None:
        """Make the phase true: ``True`` on the device, ``False`` on the host, ``None`` as is.
        Releases run before acquisitions, so the two sides never hold their memory at once."""
        if not self.memory_phases:
            return
        now = self._phase
        if not self.with_reference:
            reference = None
        if self.generators is None:
            generators = None
        offload = {
            "policy": policy is False and now.policy,
            "reference": reference is False and now.reference,
        }
        onload = {
            "policy": bool(policy) and not now.policy,
            "reference": bool(reference) and not now.reference,
        }
        if any(offload.values()):
            self._move_trainers({k: False for k, v in offload.items() if v})
        if generators == "asleep" and now.generators != "asleep":
            self._sleep_generators()
        if any(onload.values()):
            self._move_trainers({k: True for k, v in onload.items() if v})
        now.policy = now.policy if policy is None else policy
        now.reference = now.reference if reference is None else reference
        if generators in ("weights", "awake"):
            self._wake_generators(generators)

    def _move_trainers(self, residency: dict[str, bool]) -> None:
        stats = self.trainers.run("set_residency", **residency)[0]
        for key, value in stats.items():
            if key.endswith("_s"):
                self._add_metric(f"timing/{key}", value)
        if residency.get("policy") is False and "allocated_bytes" in stats:
            self._metrics["memory/trainer_bytes_offloaded"] = stats["allocated_bytes"]

    def _add_metric(self, key: str, value: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + value

    def take_metrics(self) -> dict[str, float]:
        """What the memory phases cost since the last call (seconds of offload, onload, sleep,
        wake; the trainer's device bytes after its offload, its peak during refit)."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _sleep_generators(self) -> None:
        assert self.generators is not None
        start = time.perf_counter()
        self.generators.run("sleep")
        self._add_metric("timing/generator_sleep_s", time.perf_counter() - start)
        self._phase.generators = "asleep"
        if self.discards_weights:
            self._phase.weights_current = False

    def _wake_generators(self, target: GeneratorPhase) -> None:
        assert self.generators is not None
        now = self._phase
        start = time.perf_counter()
        if now.generators == "asleep":
            tags = ["weights"] if target == "weights" else None
            self.generators.run("wake_up", tags)
            now.generators = target
        elif now.generators == "weights" and target == "awake":
            self.generators.run("wake_up", ["kv_cache"])
            now.generators = "awake"
        self._add_metric("timing/generator_wake_s", time.perf_counter() - start)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """Prompts split into contiguous chunks, one per generator; rollouts in prompt order."""
        return self.collect(self.submit_generate(prompt_token_ids, params))

    def submit_generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams
    ) -> PendingGeneration:
        """``generate`` without waiting: the generators start, the caller goes on (async GRPO
        trains meanwhile); ``collect`` returns the rollouts. A later call on the generators (a
        refit, another generation) runs after this one; with ``in_flight_refit`` a refit runs
        at once, between two decode steps of this one."""
        if self.generators is None:
            raise ValueError("this runtime was started without generators (with_generators)")
        if not self._phase.weights_current:
            self.refit()  # a deep sleep dropped the weights: never generate from garbage
        self._enter(policy=False, reference=False, generators="awake")
        chunks = _split(list(range(len(prompt_token_ids))), self.generators.num_workers)
        futures = self.generators.run_per_rank_async(
            "generate_timed",
            [
                ([prompt_token_ids[i] for i in chunk], _offset_seed(params, chunk[0]))
                for chunk in chunks
            ],
        )
        return PendingGeneration(chunks, futures)

    def collect(self, pending: PendingGeneration) -> list[Rollout]:
        """The rollouts of a ``submit_generate``, in prompt order (waits for them)."""
        assert self.generators is not None
        self._settle_refit()
        results = self.generators.get(pending.futures)
        rollouts = []
        for chunk, (chunk_rollouts, idle_s) in zip(pending.chunks, results, strict=True):
            self._add_metric("timing/generator_idle_s", idle_s / len(results))
            for rollout in chunk_rollouts:
                rollout.prompt_index = chunk[rollout.prompt_index]
                rollouts.append(rollout)
        return rollouts

    # -- training -----------------------------------------------------------------------------
    def _shards(self, batch: TrainBatch) -> list[TrainBatch]:
        n = self.trainers.num_workers
        if batch.num_sequences < n:
            raise ValueError(f"a batch of {batch.num_sequences} sequences cannot feed {n} trainers")
        bounds = torch.tensor_split(torch.arange(batch.num_sequences), n)
        return [batch.select(slice(int(b[0]), int(b[-1]) + 1)) for b in bounds]

    def policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self._enter(policy=True, reference=False, generators="asleep")
        outs = self.trainers.run_per_rank("logprobs", [(s,) for s in self._shards(batch)])
        return torch.cat(outs)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if not self.with_reference:
            raise ValueError("this runtime was started without a reference policy")
        self._enter(reference=True, generators="asleep")
        outs = self.trainers.run_per_rank("reference_logprobs", [(s,) for s in self._shards(batch)])
        return torch.cat(outs)

    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self._enter(policy=True, reference=False, generators="asleep")
        results = self.trainers.run_per_rank("train", [(s, loss_fn) for s in self._shards(batch)])
        return dict(results[0])

    # -- refit --------------------------------------------------------------------------------
    def refit(self, version: int | None = None, wait_generators: bool = True) -> dict[str, float]:
        """Trainer weights into every generator: metadata once, then buckets, concurrently.
        ``version`` labels them (the optimizer steps behind them; None: the last label given,
        the same policy sent again). With ``in_flight_refit`` it lands in a running generation.

        ``wait_generators=False`` (split placement, generators that run their calls in order)
        returns once the trainers have sent: the generators load the weights (most of a small
        model's refit, vLLM's reload) while the caller goes on, e.g. trains; their next call runs
        after the load, and ``collect`` or the next refit raises its failure."""
        if self.generators is None:
            return {}
        self._settle_refit()
        if not wait_generators and self.memory_phases:
            raise ValueError("wait_generators=False needs split placement (no memory phases)")
        self._enter(policy=True, reference=False, generators="weights")
        if self.memory_phases:  # the refit's own peak, apart from training's
            self.trainers.run("memory_stats", reset_peak=True)
        spec = self.trainers.run("prepare_refit")[0]
        sending = self.trainers.run_async("send_weights")
        if version is not None:
            self.weights_version = version
        receiving = self.generators.run_async("receive_weights", spec, self.weights_version)
        if wait_generators:
            sent, _ = get_together([(self.trainers, sending), (self.generators, receiving)])
        else:
            sent = self._sent_while_loading(sending, receiving)
        stats = sent[0]
        self._phase.weights_current = True
        if self.memory_phases:
            memory = self.trainers.run("memory_stats")[0]
            if memory:  # {} off CUDA
                self._metrics["memory/trainer_peak_refit_bytes"] = memory["peak_bytes"]
                self._metrics["memory/trainer_resident_bytes"] = memory["allocated_bytes"]
        return dict(stats)

    def _sent_while_loading(self, sending: Any, receiving: Any, poll_s: float = 0.25) -> list:
        """The trainers' send results; the generators' receive stays pending (``_loading``),
        but a generator that fails before the send ends is raised at once."""
        assert self.generators is not None
        with self._loading_lock:
            self._loading = receiving
        while not self.trainers.ready(sending, poll_s):
            if self.generators.ready(receiving, 0.0):
                self._settle_refit()
                break
        return self.trainers.get(sending)

    def _settle_refit(self) -> None:
        """Wait for the generators' side of a refit that did not wait for it; raise its failure."""
        with self._loading_lock:
            loading, self._loading = self._loading, None
        if loading is not None:
            assert self.generators is not None
            self.generators.get(loading)

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        self._enter(policy=True, generators="asleep")
        self.trainers.run("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._enter(policy=True, generators="asleep")
        self.trainers.run("load_checkpoint", path)
        self._phase.weights_current = self.generators is None

    def export_hf(self, path: str) -> None:
        self._enter(policy=True, generators="asleep")
        self.trainers.run("export_hf", path)


@dataclass(frozen=True)
class PendingGeneration:
    """A generation in progress: each generator's prompt indices and its pending result."""

    chunks: list[list[int]]
    futures: Any


def _split(items: list[int], parts: int) -> list[list[int]]:
    return [list(map(int, c)) for c in torch.tensor_split(torch.tensor(items), parts) if len(c)]


def _offset_seed(params: SamplingParams, first_prompt: int) -> SamplingParams:
    """Seeds of a chunk starting at prompt ``first_prompt``, so that sample ``j`` of prompt ``i``
    draws the same stream whatever the number of generators (``seed + i * n + j`` globally)."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + first_prompt * params.n)
