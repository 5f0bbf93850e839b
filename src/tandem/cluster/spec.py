"""What a run's runtime is made of (``Runtime.start``'s argument): importable without torch, so
the driver can describe the runtime while Ray starts and torch imports in a thread."""

from __future__ import annotations

from dataclasses import dataclass

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
