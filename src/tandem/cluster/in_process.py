"""The runtime in the driver's process (``cluster.in_process``): the plain trainer and generator
workers, called on this thread (``InlineGroup``), and a refit that copies the trainer's weight
stream into the generator. No Ray, no actor processes, no transport.

What it saves is what separate processes cost a small model on a CPU: the Ray round trip of
every call (1.5-3.5 ms each on a 2-core machine), a refit through shared memory with its
rendezvous, and each process finding its cores and caches cold after the other's turn. CPU
machines only: there are no memory phases here. The process keeps the host memory it frees, as
the actors do (``keep_freed_host_memory``).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import torch

from tandem.cluster.groups import InlineGroup
from tandem.cluster.runtime import KEEP_FREED_HOST_MEMORY, Runtime, resolved_generation
from tandem.cluster.spec import RuntimeSpec, in_process_needs

_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_MAX_": -4}
"""glibc's ``mallopt`` parameter of each ``KEEP_FREED_HOST_MEMORY`` variable (``malloc.h``)."""


def keep_freed_host_memory() -> bool:
    """``KEEP_FREED_HOST_MEMORY`` in this running process, through glibc's ``mallopt``: the
    settings the actors get as environment variables at their start. On the long CPU workload
    in process: training steps [4.84, 3.35, 3.52, 3.50] and [4.79, 3.48, 3.72, 3.54] s against
    [6.15, 3.85, 3.67, 4.03] and [6.73, 3.72, 3.84, 3.85] without (alternating runs). False
    where the C library has no ``mallopt`` (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    settings = KEEP_FREED_HOST_MEMORY.items()
    return all(mallopt(_MALLOPT[name], int(value)) == 1 for name, value in settings)


class InProcessRuntime(Runtime):
    """One trainer and one generator in this process; ``start(spec)`` builds them."""

    @property
    def where(self) -> str:
        return "in this process (cluster.in_process=false for Ray actors)"

    @classmethod
    def start(cls, spec: RuntimeSpec) -> InProcessRuntime:
        from tandem.cluster.actors import GeneratorWorker, TrainerWorker

        generation = resolved_generation(spec)
        if needs := in_process_needs(spec):
            raise ValueError("cluster.in_process=true needs " + ", ".join(needs))
        if torch.cuda.is_available():
            raise ValueError(
                "cluster.in_process=true runs on CPU machines only (on a GPU each process "
                "accounts for its own device memory: the memory phases and their metrics need "
                "the trainer and the generator apart); use Ray actors (cluster.in_process=false)"
            )
        if spec.cluster.threads_per_actor is not None:
            torch.set_num_threads(spec.cluster.threads_per_actor)
        keep_freed_host_memory()  # what the actors get at their start
        # nor transformers' "Loading weights" bar (the actors' HF_HUB_DISABLE_PROGRESS_BARS)
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        trainer = TrainerWorker(
            policy=spec.policy,
            refit=spec.refit,
            generation=generation,
            with_reference=spec.with_reference,
            total_steps=spec.total_steps,
        )
        generators = None
        if spec.with_generators:
            worker = GeneratorWorker(generation=generation, model_path=str(spec.policy.model_path))
            generators = InlineGroup([worker], "generator")
        runtime = cls(
            InlineGroup([trainer], "trainer"),
            generators,
            with_reference=spec.with_reference,
        )
        # an FP8 engine starts from dummy weights: the first generation refits first
        runtime._phase.weights_current = generation.precision != "fp8"
        return runtime

    def refit(self, version: int | None = None, wait_generators: bool = True) -> dict[str, float]:
        """The trainer's weight stream (cast, quantised, as a transport would carry it) loaded
        by the generator; ``wait_generators`` is moot (it is done when this returns)."""
        if self.generators is None:
            return {}
        # a no-op: start() builds no memory phases (tests construct some, and it keeps them)
        self._enter(policy=True, reference=False, generators="weights")
        if version is not None:
            self.weights_version = version
        assert isinstance(self.trainers, InlineGroup) and isinstance(self.generators, InlineGroup)
        trainer, generator = self.trainers.workers[0], self.generators.workers[0]
        counted = [0]

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in trainer.weight_stream():
                counted[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        start = time.perf_counter()
        generator.load_weights(stream(), self.weights_version)
        seconds = time.perf_counter() - start
        self._phase.weights_current = True
        return {
            "seconds": seconds,
            "bytes": float(counted[0]),
            "gb_per_s": counted[0] / seconds / 1e9 if seconds > 0 else 0.0,
        }
