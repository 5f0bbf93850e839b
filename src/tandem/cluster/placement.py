"""Placement of trainer and generator actors on the cluster ("virtual cluster").

``colocated``: trainer ``i`` and generator ``i`` share bundle ``i`` of one placement group (on GPU
machines they share its device, each asking half of it). ``split``: every actor owns a bundle;
the bundles are disjoint and may span nodes. Resources are GPUs on GPU clusters (plus CPUs) and
CPUs on CPU clusters; fractional CPUs per actor let a small machine host several actors.

Public API
----------
``ActorSlot(placement_group, bundle_index, num_cpus, num_gpus)``: where one actor goes;
  ``.options() -> dict`` for ``ActorClass.options(**...)``.
``Placement(mode, trainer_bundles, generator_bundles, placement_group)``; ``.remove()``.
``create_placement(mode, num_trainers, num_generators, cpus_per_actor=1.0, gpus_per_actor=1.0,
  use_gpus=None, timeout_s=60.0) -> Placement``
``make_placement(cluster: ClusterConfig) -> Placement`` (the same, from the config section).
``actor_threads(cluster, num_cores=None) -> int``: the CPU threads each actor computes with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

if TYPE_CHECKING:
    from tandem.config.models import ClusterConfig

PlacementMode = Literal["colocated", "split"]


@dataclass(frozen=True)
class ActorSlot:
    """One actor's share of one bundle of a placement group."""

    placement_group: PlacementGroup
    bundle_index: int
    num_cpus: float
    num_gpus: float = 0.0

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.remote(cls).options(...)``."""
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.bundle_index,
            ),
        }


@dataclass
class Placement:
    """The actor slots of one run; ``remove()`` frees the placement group."""

    mode: PlacementMode
    trainer_bundles: list[ActorSlot]
    generator_bundles: list[ActorSlot]
    placement_group: PlacementGroup

    def remove(self) -> None:
        remove_placement_group(self.placement_group)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


def _layout(
    mode: PlacementMode, num_trainers: int, num_generators: int, cpus: float, gpus: float
) -> tuple[list[dict[str, float]], list[tuple[int, float, float]], list[tuple[int, float, float]]]:
    """Bundles, then (bundle index, cpus, gpus) per trainer and per generator."""
    if mode == "split":
        bundles = [_bundle(cpus, gpus) for _ in range(num_trainers + num_generators)]
        trainers = [(i, cpus, gpus) for i in range(num_trainers)]
        generators = [(num_trainers + i, cpus, gpus) for i in range(num_generators)]
        return bundles, trainers, generators
    num_bundles = max(num_trainers, num_generators)
    bundles = []
    trainers, generators = [], []
    for i in range(num_bundles):
        sharing = int(i < num_trainers) + int(i < num_generators)
        # Both actors of a shared bundle see the same device: each asks its share of it.
        bundles.append(_bundle(cpus * sharing, gpus))
        if i < num_trainers:
            trainers.append((i, cpus, gpus / sharing))
        if i < num_generators:
            generators.append((i, cpus, gpus / sharing))
    return bundles, trainers, generators


def create_placement(
    mode: PlacementMode,
    num_trainers: int,
    num_generators: int,
    cpus_per_actor: float = 1.0,
    gpus_per_actor: float = 1.0,
    use_gpus: bool | None = None,
    timeout_s: float = 60.0,
) -> Placement:
    """Reserve the bundles of ``mode`` and wait until they are placed.

    ``use_gpus=None`` asks for GPUs iff the cluster has any. Raises ValueError naming the
    shortfall when the cluster cannot hold them within ``timeout_s``."""
    if mode not in ("colocated", "split"):
        raise ValueError(f"placement must be 'colocated' or 'split', got {mode!r}")
    if num_trainers < 0 or num_generators < 0 or num_trainers + num_generators == 0:
        raise ValueError(f"need at least one actor, got {num_trainers=} {num_generators=}")
    if use_gpus is None:
        use_gpus = ray.cluster_resources().get("GPU", 0) > 0
    gpus = gpus_per_actor if use_gpus else 0.0
    bundles, trainers, generators = _layout(
        mode, num_trainers, num_generators, cpus_per_actor, gpus
    )
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        need_cpu = sum(b["CPU"] for b in bundles)
        need_gpu = sum(b.get("GPU", 0) for b in bundles)
        raise ValueError(
            f"{mode} placement needs {need_cpu:g} CPUs and {need_gpu:g} GPUs in "
            f"{len(bundles)} bundles, but the cluster has {ray.available_resources()} free; "
            "lower cluster.cpus_per_actor/gpus_per_actor or the number of actors, or add nodes"
        )

    def slots(layout: list[tuple[int, float, float]]) -> list[ActorSlot]:
        return [ActorSlot(group, index, c, g) for index, c, g in layout]

    return Placement(mode, slots(trainers), slots(generators), group)


def make_placement(cluster: ClusterConfig) -> Placement:
    """``create_placement`` from the ``cluster`` config section."""
    return create_placement(
        cluster.placement,
        cluster.num_trainers,
        cluster.num_generators,
        cpus_per_actor=cluster.cpus_per_actor,
        gpus_per_actor=cluster.gpus_per_actor,
    )


def actor_threads(cluster: ClusterConfig, num_cores: int | None = None) -> int:
    """Threads per actor: ``cluster.threads_per_actor``, else this node's cores (``num_cores``,
    default the cores this process may run on) over the actors computing at the same time.

    Ray gives an actor ``OMP_NUM_THREADS`` = its CPU request (1 for a fraction), so colocated
    actors, which take turns, each computed on one core of two; they get the whole share."""
    if cluster.threads_per_actor is not None:
        return cluster.threads_per_actor
    cores = num_cores or len(os.sched_getaffinity(0))
    if cluster.placement == "colocated":
        concurrent = max(cluster.num_trainers, cluster.num_generators)
    else:
        concurrent = cluster.num_trainers + cluster.num_generators
    return max(1, cores // concurrent)
