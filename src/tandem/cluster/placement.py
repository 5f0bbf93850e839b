"""Placement of trainer and generator actors on the cluster ("virtual cluster").

``colocated``: trainer ``i`` and generator ``i`` share bundle ``i`` of one placement group (on GPU
machines they share its device, each asking half of it). ``split``: every actor owns a bundle;
the bundles are disjoint and may span nodes. Resources are GPUs on GPU clusters (plus CPUs) and
CPUs on CPU clusters; fractional CPUs per actor let a small machine host several actors.

Public API
----------
``ActorSlot(placement_group, bundle_index, num_cpus, num_gpus)``: where one actor goes;
  ``.options() -> dict`` for ``ActorClass.options(**...)``.
``Placement(mode, trainer_bundles, generator_bundles, placement_group, scorer_bundles)``;
  ``.remove()``.
``create_placement(mode, num_trainers, num_generators, cpus_per_actor=1.0, gpus_per_actor=1.0,
  use_gpus=None, timeout_s=60.0, num_scorers=0, scorer_mode="colocated") -> Placement``
``make_placement(cluster: ClusterConfig, num_scorers=0, scorer_mode="colocated")`` (the same,
  from the config section).

Scorers (a reward model, a judge, a teacher; ``reward.placement``) get slots of the same
placement group: ``colocated`` they share bundle 0 and its device with trainer 0 and generator 0
(each asking its share; they hold their weights on the host between calls), ``split`` each owns
a bundle of its own.
``actor_threads(cluster, num_cores=None) -> int``: the CPU threads each actor computes with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
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
    scorer_bundles: list[ActorSlot] = field(default_factory=list)

    def remove(self) -> None:
        remove_placement_group(self.placement_group)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


Slot = tuple[int, float, float]
"""(bundle index, cpus, gpus) of one actor."""


def _layout(
    mode: PlacementMode,
    num_trainers: int,
    num_generators: int,
    cpus: float,
    gpus: float,
    num_scorers: int = 0,
    scorer_mode: PlacementMode = "colocated",
) -> tuple[list[dict[str, float]], list[Slot], list[Slot], list[Slot]]:
    """Bundles, then the slots of the trainers, the generators and the scorers."""
    trainers = list(range(num_trainers))
    if mode == "split":
        generators = [num_trainers + i for i in range(num_generators)]
        num_bundles = num_trainers + num_generators
    else:
        generators = list(range(num_generators))
        num_bundles = max(num_trainers, num_generators)
    scorers = [0] * num_scorers
    if scorer_mode == "split":
        scorers = [num_bundles + i for i in range(num_scorers)]
        num_bundles += num_scorers
    # Actors of a shared bundle see the same device: each asks its share of it.
    everyone = [*trainers, *generators, *scorers]
    sharing = [everyone.count(b) for b in range(num_bundles)]

    def slots(indices: list[int]) -> list[Slot]:
        return [(b, cpus, gpus / sharing[b]) for b in indices]

    bundles = [_bundle(cpus * n, gpus) for n in sharing]
    return bundles, slots(trainers), slots(generators), slots(scorers)


def create_placement(
    mode: PlacementMode,
    num_trainers: int,
    num_generators: int,
    cpus_per_actor: float = 1.0,
    gpus_per_actor: float = 1.0,
    use_gpus: bool | None = None,
    timeout_s: float = 60.0,
    num_scorers: int = 0,
    scorer_mode: PlacementMode = "colocated",
) -> Placement:
    """Reserve the bundles of ``mode`` (and ``num_scorers`` scorer slots placed as
    ``scorer_mode`` says) and wait until they are placed.

    ``use_gpus=None`` asks for GPUs iff the cluster has any. Raises ValueError naming the
    shortfall when the cluster cannot hold them within ``timeout_s``."""
    if mode not in ("colocated", "split"):
        raise ValueError(f"placement must be 'colocated' or 'split', got {mode!r}")
    if num_trainers < 0 or num_generators < 0 or num_trainers + num_generators == 0:
        raise ValueError(f"need at least one actor, got {num_trainers=} {num_generators=}")
    if use_gpus is None:
        use_gpus = ray.cluster_resources().get("GPU", 0) > 0
    gpus = gpus_per_actor if use_gpus else 0.0
    bundles, trainers, generators, scorers = _layout(
        mode, num_trainers, num_generators, cpus_per_actor, gpus, num_scorers, scorer_mode
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

    def slots(layout: list[Slot]) -> list[ActorSlot]:
        return [ActorSlot(group, index, c, g) for index, c, g in layout]

    return Placement(mode, slots(trainers), slots(generators), group, slots(scorers))


def make_placement(
    cluster: ClusterConfig, num_scorers: int = 0, scorer_mode: PlacementMode = "colocated"
) -> Placement:
    """``create_placement`` from the ``cluster`` config section."""
    return create_placement(
        cluster.placement,
        cluster.num_trainers,
        cluster.num_generators,
        cpus_per_actor=cluster.cpus_per_actor,
        gpus_per_actor=cluster.gpus_per_actor,
        num_scorers=num_scorers,
        scorer_mode=scorer_mode,
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
