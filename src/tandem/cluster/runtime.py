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
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from tandem.cluster.groups import Group, WorkerError
from tandem.cluster.refit import RefitStrategy, TransportRefit
from tandem.contracts import LossFn, PendingGeneration
from tandem.data.batch import TrainBatch

if TYPE_CHECKING:
    from tandem.generation.base import Rollout, SamplingParams

logger = logging.getLogger(__name__)

GeneratorPhase = Literal["asleep", "weights", "awake"]
"""asleep: no device memory; weights: weights resident, no KV cache; awake: ready to generate."""


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
    """Worker groups of one run, as the algorithm calls them (``RolloutRuntime``), built by a
    launcher (``cluster.launch``) or, in tests and tools, from any ``Group``s (``LocalGroup``
    of plain workers). ``close()`` (or a ``with`` block) shuts them down.

    ``refit``: how weights reach the generators (``cluster.refit``; default the transport).
    ``memory_phases`` turns on the colocated-GPU phases (module docstring); ``discards_weights``:
    a generator's sleep drops its weights (a refit must follow before it generates again);
    ``weights_current``: the generators start with the trainer's weights (False for an FP8
    engine, which starts from dummy weights); ``where``: where the workers run, for the log."""

    def __init__(
        self,
        trainers: Group,
        generators: Group | None = None,
        *,
        refit: RefitStrategy | None = None,
        memory_phases: bool = False,
        discards_weights: bool = False,
        with_reference: bool = False,
        weights_current: bool = True,
        on_close: Callable[[], None] | None = None,
        engine_shutdown: bool = True,
        where: str = "in this process",
    ):
        self.trainers, self.generators = trainers, generators
        self._refit = refit if refit is not None else TransportRefit()
        self.engine_shutdown = engine_shutdown  # off where killing a worker ends its engine
        self.memory_phases, self.discards_weights = memory_phases, discards_weights
        self.with_reference, self.where = with_reference, where
        self.placement: Any = None  # the Ray placement group of the actors (None here)
        self._on_close = on_close
        self._phase = _Phase(weights_current=weights_current)
        self._metrics: dict[str, float] = {}
        self.weights_version = 0  # the generators' weights: the ``version`` of the last refit
        self.on_phase: Callable[[str], None] = lambda call: None
        """Told each call's name as it starts (generate, train, refit, ...): the progress bar's."""

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
        call: str,
        policy: bool | None = None,
        reference: bool | None = None,
        generators: GeneratorPhase | None = None,
    ) -> None:
        """Make the phase true: ``True`` on the device, ``False`` on the host, ``None`` as is.
        Releases run before acquisitions, so the two sides never hold their memory at once.
        ``call``: the name of the call that needs it, told to ``on_phase``."""
        self.on_phase(call)
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
        self._phase.weights_current &= not self.discards_weights  # a deep sleep drops them

    def _wake_generators(self, target: GeneratorPhase) -> None:
        assert self.generators is not None
        now = self._phase
        start = time.perf_counter()
        if now.generators == "asleep":
            if now.policy or now.reference:  # a resident trainer keeps its state, not its blocks
                self.trainers.run("release_cached_memory")
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
        self._enter("generate", policy=False, reference=False, generators="awake")
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
        self._refit.settle(self.generators)
        results = self.generators.get(pending.futures)
        rollouts = []
        for chunk, (chunk_rollouts, idle_s, stats) in zip(pending.chunks, results, strict=True):
            for name, value in {"timing/generator_idle_s": idle_s / len(results), **stats}.items():
                self._add_metric(name, value)  # idle: the generators' mean; the rest: their sum
            for rollout in chunk_rollouts:
                rollout.prompt_index = chunk[rollout.prompt_index]
            rollouts += chunk_rollouts
        return rollouts

    # -- training -----------------------------------------------------------------------------
    def _shards(self, batch: TrainBatch) -> list[TrainBatch]:
        n = self.trainers.num_workers
        if batch.num_sequences < n:
            raise ValueError(f"a batch of {batch.num_sequences} sequences cannot feed {n} trainers")
        bounds = torch.tensor_split(torch.arange(batch.num_sequences), n)
        return [batch.select(slice(int(b[0]), int(b[-1]) + 1)) for b in bounds]

    def policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self._enter("logprobs", policy=True, reference=False, generators="asleep")
        outs = self.trainers.run_per_rank("logprobs", [(s,) for s in self._shards(batch)])
        return torch.cat(outs)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if not self.with_reference:
            raise ValueError("this runtime was started without a reference policy")
        self._enter("reference logprobs", reference=True, generators="asleep")
        outs = self.trainers.run_per_rank("reference_logprobs", [(s,) for s in self._shards(batch)])
        return torch.cat(outs)

    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self._enter("train", policy=True, reference=False, generators="asleep")
        results = self.trainers.run_per_rank("train", [(s, loss_fn) for s in self._shards(batch)])
        return dict(results[0])

    # -- refit --------------------------------------------------------------------------------
    def refit(self, version: int | None = None, wait_generators: bool = True) -> dict[str, float]:
        """Trainer weights into every generator (the launcher's ``RefitStrategy``). ``version``
        labels them (the optimizer steps behind them; None: the last label given, the same
        policy sent again). With ``in_flight_refit`` it lands in a running generation.

        ``wait_generators=False`` (split placement, generators that run their calls in order)
        returns once the trainers have sent: the generators load (most of a small model's
        refit) while the caller trains; ``collect`` or the next refit raises their failure."""
        if self.generators is None:
            return {}
        self._refit.settle(self.generators)
        if not wait_generators and self.memory_phases:
            raise ValueError("wait_generators=False needs split placement (no memory phases)")
        self._enter("refit", policy=True, reference=False, generators="weights")
        if self.memory_phases:  # the refit's own peak, apart from training's
            self.trainers.run("memory_stats", reset_peak=True)
        self.weights_version = self.weights_version if version is None else version
        stats = self._refit.send(
            self.trainers, self.generators, self.weights_version, wait_generators
        )
        self._phase.weights_current = True
        if self.memory_phases:
            memory = self.trainers.run("memory_stats")[0]
            if memory:  # {} off CUDA
                self._metrics["memory/trainer_peak_refit_bytes"] = memory["peak_bytes"]
                self._metrics["memory/trainer_resident_bytes"] = memory["allocated_bytes"]
        return stats

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        self._enter("checkpoint", policy=True, generators="asleep")
        self.trainers.run("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._enter("load checkpoint", policy=True, generators="asleep")
        self.trainers.run("load_checkpoint", path)
        self._phase.weights_current = self.generators is None

    def export_hf(self, path: str) -> None:
        self._enter("export", policy=True, generators="asleep")
        self.trainers.run("export_hf", path)


def _split(items: list[int], parts: int) -> list[list[int]]:
    return [list(map(int, c)) for c in torch.tensor_split(torch.tensor(items), parts) if len(c)]


def _offset_seed(params: SamplingParams, first_prompt: int) -> SamplingParams:
    """Seeds of a chunk starting at prompt ``first_prompt``, so that sample ``j`` of prompt ``i``
    draws the same stream whatever the number of generators (``seed + i * n + j`` globally)."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + first_prompt * params.n)
