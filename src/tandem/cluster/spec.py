"""What a run's runtime is made of (``Runtime.start``'s argument): importable without torch, so
the driver can describe the runtime while Ray starts and torch imports in a thread."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from importlib.util import find_spec

from tandem.config.models import ClusterConfig, GenerationConfig, PolicyConfig, RefitConfig


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
    in_flight_refit: bool = False
    """A refit may reach the generators while they generate (``algorithm.refit_mode``): each
    generator actor takes two calls at once and lets the refit in between two decode steps."""

    def __post_init__(self) -> None:
        if self.cluster.in_process is None:
            fits = fits_in_process(self)
            self.cluster = self.cluster.model_copy(update={"in_process": fits})


def fits_in_process(spec: RuntimeSpec) -> bool:
    """Whether the run of ``spec`` can run in this process (``cluster.in_process=None``): one
    trainer and one generator taking turns on a CPU machine, with what they import importable
    here. Checked before torch is imported: a GPU is seen by its device files."""
    cluster, generation = spec.cluster, spec.generation
    needs_vllm = spec.with_generators and generation.backend == "vllm"
    return (
        cluster.num_trainers == 1
        and cluster.num_generators == 1
        and cluster.placement == "colocated"
        and cluster.address is None
        and not os.environ.get("RAY_ADDRESS")
        and generation.tensor_parallel_size == 1
        and not spec.in_flight_refit
        and not glob.glob("/dev/nvidia[0-9]*")
        and (not needs_vllm or find_spec("vllm") is not None)
    )
