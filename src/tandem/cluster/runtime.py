"""The RL runtime: trainer and generator worker groups on a Ray cluster, and the calls the
algorithm makes on them. Placement (colocated/split), the memory phases of colocated GPUs and the
refit transport are handled here, so the algorithm never branches on them."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.config.models import ClusterConfig, GenerationConfig, PolicyConfig, RefitConfig
from tandem.data.batch import TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class RuntimeSpec:
    cluster: ClusterConfig
    policy: PolicyConfig
    generation: GenerationConfig
    refit: RefitConfig
    with_reference: bool = False
    with_generators: bool = True
    total_steps: int | None = None
    """Optimizer steps of the run (the learning-rate schedule's horizon)."""


class Runtime:
    """Worker groups of one run. ``close()`` (or a ``with`` block) shuts them down."""

    def __init__(self, spec: RuntimeSpec):
        from tandem.cluster.placement import make_placement
        from tandem.cluster.ray_cluster import init_ray
        from tandem.cluster.worker_group import WorkerGroup

        cluster = spec.cluster
        init_ray(address=cluster.address)
        refit = spec.refit
        if refit.transport == "auto":
            refit = refit.model_copy(update={"transport": cluster.placement})
        placement = make_placement(cluster)
        self._placement = placement
        self.colocated_gpu = cluster.placement == "colocated" and torch.cuda.is_available()
        self.trainers = WorkerGroup(
            TrainerWorker,
            cluster.num_trainers,
            kind="trainer",
            kwargs=dict(
                policy=spec.policy,
                refit=refit,
                generation=spec.generation,
                with_reference=spec.with_reference,
                num_receivers=cluster.num_generators * spec.generation.tensor_parallel_size,
                total_steps=spec.total_steps,
            ),
            bundles=placement.trainer_bundles,
            env_mode=cluster.env_mode,
        )
        self.generators = None
        if spec.with_generators:
            self.generators = WorkerGroup(
                GeneratorWorker,
                cluster.num_generators,
                kind="generator",
                kwargs=dict(generation=spec.generation, model_path=str(spec.policy.model_path)),
                bundles=placement.generator_bundles,
                env_mode=cluster.env_mode,
            )

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engines down, kill every actor and free the placement group. A worker that
        died (or whose shutdown fails) does not keep the other actors and the bundles held."""
        from tandem.cluster.worker_group import WorkerError

        try:
            if self.generators is not None:
                try:
                    self.generators.run("shutdown")
                except WorkerError as err:
                    # killing the actor below ends its engine with its process anyway
                    logger.warning("generator shutdown failed; killing the actors: %s", err)
                self.generators.shutdown()
        finally:
            self.trainers.shutdown()
            self._placement.remove()

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: Any) -> list[Any]:
        """Prompts split into contiguous chunks, one per generator; rollouts in prompt order."""
        assert self.generators is not None
        chunks = _split(list(range(len(prompt_token_ids))), self.generators.num_workers)
        results = self.generators.run_per_rank(
            "generate",
            [
                ([prompt_token_ids[i] for i in chunk], _offset_seed(params, chunk[0]))
                for chunk in chunks
            ],
        )
        rollouts = []
        for chunk, chunk_rollouts in zip(chunks, results, strict=True):
            for rollout in chunk_rollouts:
                rollout.prompt_index = chunk[rollout.prompt_index]
                rollouts.append(rollout)
        return rollouts

    # -- training ---------------------------------------------------------------------------
    def _shards(self, batch: TrainBatch) -> list[TrainBatch]:
        n = self.trainers.num_workers
        if batch.num_sequences < n:
            raise ValueError(f"a batch of {batch.num_sequences} sequences cannot feed {n} trainers")
        bounds = torch.tensor_split(torch.arange(batch.num_sequences), n)
        return [batch.select(slice(int(b[0]), int(b[-1]) + 1)) for b in bounds]

    def policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        outs = self.trainers.run_per_rank("logprobs", [(s,) for s in self._shards(batch)])
        return torch.cat(outs)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        outs = self.trainers.run_per_rank("reference_logprobs", [(s,) for s in self._shards(batch)])
        return torch.cat(outs)

    def train(self, batch: TrainBatch, loss_fn: Any) -> dict[str, float]:
        if self.colocated_gpu and self.generators is not None:
            self.generators.run("sleep")
            self.trainers.run("onload")
        results = self.trainers.run_per_rank("train", [(s, loss_fn) for s in self._shards(batch)])
        return results[0]

    # -- refit ------------------------------------------------------------------------------
    def refit(self) -> dict[str, float]:
        """Trainer weights into every generator: metadata once, then buckets, concurrently."""
        if self.generators is None:
            return {}
        if self.colocated_gpu:
            self.generators.run("wake_up")
        spec = self.trainers.run("prepare_refit")[0]
        sending = self.trainers.run_async("send_weights")
        receiving = self.generators.run_async("receive_weights", spec)
        stats = self.trainers.get(sending)[0]
        self.generators.get(receiving)
        if self.colocated_gpu:
            self.trainers.run("offload")
        return stats

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        self.trainers.run("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.trainers.run("load_checkpoint", path)

    def export_hf(self, path: str) -> None:
        self.trainers.run("export_hf", path)


def _split(items: list[int], parts: int) -> list[list[int]]:
    return [list(map(int, c)) for c in torch.tensor_split(torch.tensor(items), parts) if len(c)]


def _offset_seed(params: Any, first_prompt: int) -> Any:
    """Seeds of a chunk starting at prompt ``first_prompt``, so that sample ``j`` of prompt ``i``
    draws the same stream whatever the number of generators (``seed + i * n + j`` globally)."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + first_prompt * params.n)
