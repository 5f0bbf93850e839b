"""Whether a trainer's state fits its GPU, known before it moves there.

The state a trainer keeps on its device through a step is its shard of the weights and, for
what trains, of the gradients and AdamW's two moments, all in the weights' dtype: 16 bytes a
trained parameter with fp32 master weights, 8 in bf16. No micro-batch setting changes that, so
a state larger than the device is refused with the settings that do change it, instead of an
out-of-memory error after the model has loaded and a first generation has run. Likewise the
host memory a colocated trainer's offloads page-lock (``check_offload_fits``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tandem.config.load import ConfigError
from tandem.config.models import PolicyConfig

TRAINED_COPIES = 4
"""A trained parameter's copies on the device during a step: itself, its gradient, AdamW's
two moments (``torch.optim.AdamW`` and torchao's keep them in the parameter's dtype)."""


def state_bytes(parameters: Iterable[torch.Tensor], world_size: int) -> tuple[int, int, int]:
    """(bytes on each rank's device, parameters, trained parameters): ``parameters`` as
    ``Module.parameters()`` gives them (a tied weight once); FSDP2 shards all of it over
    ``world_size`` ranks."""
    total = count = trained = 0
    for param in parameters:
        copies = TRAINED_COPIES if param.requires_grad else 1
        total += param.numel() * param.element_size() * copies
        count += param.numel()
        trained += param.numel() if param.requires_grad else 0
    return -(-total // world_size), count, trained


def state_fit_problem(
    config: PolicyConfig,
    need: int,
    count: int,
    trained: int,
    world_size: int,
    have: int,
    device_name: str,
) -> str | None:
    """What to change where ``need`` bytes on each rank exceed the device's ``have``; None where
    they fit (activations, the generator's turn and the CUDA context still need room)."""
    if need <= have:
        return None
    fixes = [
        f"train on more GPUs (cluster.num_trainers={world_size * 2} halves each one's share)",
        "keep the state on the host (policy.cpu_offload=true)",
    ]
    if config.lora is None:
        fixes.append("train low-rank adapters instead of every weight (policy.lora)")
    if config.dtype == "float32" and trained:
        fixes.append(
            "keep the weights and AdamW's state in bf16, rounded stochastically, half the bytes "
            "(policy.dtype=bfloat16 policy.mixed_precision=false "
            "policy.optimizer.bf16_stochastic_round=true)"
        )
    what = f"{count / 1e9:.2f} B parameters in {config.dtype}"
    if trained:
        what += f", {trained / 1e9:.2f} B of them trained (with gradients and AdamW's moments)"
    share = f", sharded over {world_size} trainers," if world_size > 1 else ""
    return (
        f"policy: the trainer's state does not fit its GPU: {what}{share} take "
        f"{need / 1e9:.1f} GB of {'each' if world_size > 1 else 'the'} {device_name}'s "
        f"{have / 1e9:.1f} GB. "
        f"To fit it: {'; or '.join(fixes)}"
    )


def check_state_fits(
    module: torch.nn.Module, config: PolicyConfig, world_size: int, device: torch.device
) -> None:
    """Raise ``ConfigError`` where ``module``'s state (as it will train: ``requires_grad`` set)
    cannot fit ``device``. Nothing to check off CUDA or with ``policy.cpu_offload``."""
    if device.type != "cuda" or config.cpu_offload:
        return
    need, count, trained = state_bytes(module.parameters(), world_size)
    refuse_unfit(
        device,
        lambda have, name: state_fit_problem(config, need, count, trained, world_size, have, name),
    )


def refuse_unfit(device: torch.device, problem: Callable[[int, str], str | None]) -> None:
    """Raise ``ConfigError`` with what ``problem`` says of ``device``'s memory (its total bytes
    and its name), if anything."""
    properties = torch.cuda.get_device_properties(device)
    message = problem(properties.total_memory, properties.name)
    if message is not None:
        raise ConfigError(message)


def reward_model_fit_problem(
    need: int, count: int, trained: int, dtype: str, have: int, device_name: str, unfreezes: bool
) -> str | None:
    """``state_fit_problem`` for ``tandem rm``'s reward model (plain AdamW, its moments in the
    parameters' dtype; ``trained``: the parameters that train at the run's widest, all of them
    once ``unfreezes``); None where ``need`` fits the device's ``have``."""
    if need <= have:
        return None
    fixes = ["train its top layers alone (model.trainable_layers, e.g. 4)"]
    if unfreezes:
        fixes = ["keep training its top layers alone (model.unfreeze_after: null)"]
    if dtype == "float32":
        fixes.append("keep its parameters and AdamW's state in bf16 (model.dtype=bfloat16)")
    fixes.append("start from a smaller model (model.model_path)")
    return (
        f"model: the reward model's training state does not fit its GPU: {count / 1e9:.2f} B "
        f"parameters in {dtype}, {trained / 1e9:.2f} B of them trained (with gradients and "
        f"AdamW's moments), take {need / 1e9:.1f} GB of the {device_name}'s "
        f"{have / 1e9:.1f} GB. To fit it: {'; or '.join(fixes)}"
    )


def reward_model_state(module: torch.nn.Module, unfreezes: bool) -> tuple[int, int, int]:
    """``state_bytes`` of a reward model on one device: its parameters as they train first
    (``requires_grad`` set), or every one of them where it ``unfreezes`` later."""
    params: list[torch.Tensor] = list(module.parameters())
    if unfreezes:
        params = [p.detach().requires_grad_() for p in params]
    return state_bytes(params, 1)


def check_reward_model_fits(
    module: torch.nn.Module, dtype: str, unfreezes: bool, device: torch.device
) -> None:
    """Raise ``ConfigError`` where a reward model's training state cannot fit ``device``:
    ``module`` as it trains first (``requires_grad`` set), every parameter if it ``unfreezes``
    later. Called before the optimizer exists."""
    if device.type != "cuda":
        return
    need, count, trained = reward_model_state(module, unfreezes)
    refuse_unfit(
        device,
        lambda have, name: reward_model_fit_problem(
            need, count, trained, dtype, have, name, unfreezes
        ),
    )


def megatron_state_bytes(count: int, bf16: bool, trainable: bool, data_parallel: int) -> int:
    """Bytes on one rank of a Megatron-core trainer whose model slice (its tensor- and
    pipeline-parallel part) holds ``count`` parameters: the weights (bf16 or fp32) and, where it
    trains, DDP's fp32 gradient buffer and the distributed optimizer's fp32 main weights (with
    bf16 weights) and Adam's two fp32 moments, sharded over the ``data_parallel`` ranks."""
    weights = count * (2 if bf16 else 4)
    if not trainable:
        return weights
    sharded = count * ((4 if bf16 else 0) + 8)
    return weights + count * 4 + -(-sharded // data_parallel)


def megatron_fit_problem(
    config: PolicyConfig, need: int, count: int, world_size: int, have: int, device_name: str
) -> str | None:
    """``state_fit_problem`` for the Megatron-core trainer: what to change where its ``need``
    bytes on each rank exceed the device's ``have``; None where they fit."""
    if need <= have:
        return None
    layout = config.megatron
    split = layout.tensor_parallel_size * layout.pipeline_parallel_size
    return (
        f"policy: the Megatron trainer's state does not fit its GPU: {count / 1e9:.2f} B "
        f"parameters on each rank (tensor x pipeline parallel {split}) with their gradients and "
        f"Adam's state take {need / 1e9:.1f} GB of the {device_name}'s {have / 1e9:.1f} GB. To "
        "fit it: split the model over more GPUs (policy.megatron.tensor_parallel_size or "
        "pipeline_parallel_size, cluster.num_trainers a multiple of their product); or shard "
        "the optimizer state over more data-parallel ranks "
        f"(cluster.num_trainers={world_size * 2}); "
        "or train with policy.backend=fsdp2, which can keep bf16 state rounded stochastically "
        "(policy.dtype=bfloat16 policy.mixed_precision=false "
        "policy.optimizer.bf16_stochastic_round=true), offload it (policy.cpu_offload=true) or "
        "train adapters (policy.lora)"
    )


def check_megatron_state_fits(
    module: torch.nn.Module,
    config: PolicyConfig,
    bf16: bool,
    trainable: bool,
    world_size: int,
    device: torch.device,
) -> None:
    """Raise ``ConfigError`` where a Megatron-core trainer's state (``module``: this rank's model
    slice, built, before its gradient buffers and optimizer) cannot fit ``device``."""
    if device.type != "cuda":
        return
    layout = config.megatron
    data_parallel = max(
        1, world_size // (layout.tensor_parallel_size * layout.pipeline_parallel_size)
    )
    count = sum(p.numel() for p in module.parameters())
    need = megatron_state_bytes(count, bf16, trainable, data_parallel)
    refuse_unfit(
        device, lambda have, name: megatron_fit_problem(config, need, count, world_size, have, name)
    )


def host_fit_problem(
    need: int, available: int, local_ranks: int, megatron: bool = False
) -> str | None:
    """What to change where an offload of ``need`` bytes on each of ``local_ranks`` trainer
    ranks of a host exceeds the host memory ``available``; None where it fits. ``megatron``:
    the Megatron-core trainer's (whose offload moves everything, its state in fp32)."""
    if need * local_ranks <= available:
        return None
    ranks = f" on each of this host's {local_ranks} trainer ranks" if local_ranks > 1 else ""
    keep = (
        "keep the whole trainer on the GPU through generation (cluster.memory_phases=false, "
        "where one GPU holds both)"
    )
    if megatron:
        fixes = (
            f"{keep}; or split the model over more GPUs of more hosts "
            "(policy.megatron.tensor_parallel_size or pipeline_parallel_size); or train with "
            "policy.backend=fsdp2, whose offload can leave the weights on the GPU "
            "(policy.offload_weights=false)"
        )
    else:
        fixes = (
            "offload the optimizer state alone and keep the weights on the GPU "
            f"(policy.offload_weights=false); or {keep}; or shrink the state (policy.dtype="
            "bfloat16 policy.mixed_precision=false policy.optimizer.bf16_stochastic_round=true, "
            "or policy.lora)"
        )
    return (
        f"cluster.memory_phases: the trainer's offload needs {need / 1e9:.1f} GB of page-locked "
        f"host memory{ranks} (its weights and optimizer state leave the GPU while the generator "
        f"works), and the host has {available / 1e9:.1f} GB available. To fit it: {fixes}; or "
        "free host memory"
    )


def available_host_bytes() -> int:
    """The host memory available now without swapping (Linux's ``MemAvailable``: free pages
    and the caches the kernel can drop); elsewhere the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_offload_fits(num_bytes: int, megatron: bool = False) -> None:
    """Raise ``ConfigError`` where this host cannot page-lock ``num_bytes`` for each of its
    trainer ranks (``LOCAL_WORLD_SIZE``, set by the Ray runtime) now: pinning it would fail
    or bring the kernel's out-of-memory killer, minutes into the run."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    problem = host_fit_problem(num_bytes, available_host_bytes(), local_ranks, megatron)
    if problem is not None:
        raise ConfigError(problem)
