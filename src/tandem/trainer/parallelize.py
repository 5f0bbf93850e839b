"""Distribution applied from outside the model (torchtitan style): FSDP2 per decoder layer and
at the root, optional activation checkpointing. Model code never sees torch.distributed."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from tandem import rendezvous
from tandem.config.models import PolicyConfig

STORE_TIMEOUT_S = 1800.0
"""How long the trainers' rendezvous waits for every rank (torch's default)."""


def uses_fsdp(config: PolicyConfig, world_size: int) -> bool:
    """Whether the model is sharded. One rank without mixed precision or CPU offload trains the
    plain module: FSDP2 over one rank computes the same fp32 numbers (gathers and reduce-scatters
    over one rank are copies), so 1-rank vs N-rank runs stay comparable while one-process tests
    and tools need no process group."""
    return world_size > 1 or config.mixed_precision or config.cpu_offload


GATHERED_SHARE = 1 / 16
"""The most of a GPU's memory a kept-gathered compute-dtype copy of the model may take
(``stays_gathered``): 5 GB of 80 GB, a 1.5B model in bf16 but not a 3B one."""


def stays_gathered(
    config: PolicyConfig, world_size: int, model: nn.Module, device: torch.device
) -> bool:
    """Whether FSDP2 keeps the compute-dtype parameters gathered from the first forward of a
    step to its end, and reduces the gradients once, after the last micro-batch: one rank,
    without CPU offload, a model whose compute-dtype copy is small beside the device's memory
    (``GATHERED_SHARE``; any size on a CPU). There a gather is a cast and a copy and a reduction
    a copy, redone for every layer of every micro-batch (twice a layer with activation
    checkpointing); kept, the ops are the same numbers (the gradients add up in fp32 in the same
    order), and the memory is one compute-dtype copy of the model for the step
    (``PolicyTrainer.train`` reshards after it). A small model's micro-batches are bound by
    those per-layer calls; a large one's by arithmetic, while its copy would take memory its
    activations and a colocated generator need. Several ranks would each hold the whole model,
    what FSDP2 exists to avoid."""
    if world_size != 1 or not uses_fsdp(config, world_size) or config.cpu_offload:
        return False
    if device.type != "cuda":
        return True
    width = 2 if config.mixed_precision or config.dtype == "bfloat16" else 4
    copy_bytes = width * sum(p.numel() for p in model.parameters())
    return copy_bytes <= GATHERED_SHARE * torch.cuda.get_device_properties(device).total_memory


def init_distributed(rank: int, world_size: int, device: torch.device) -> None:
    """Join the trainers' default process group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    (the worker group sets them); a lone rank without them serves its store on a free local
    port of its own, each time (a trainer built again after ``destroy_process_group`` would
    otherwise find the old port taken). NCCL on CUDA, gloo on CPU. A no-op when a group
    already exists."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"the default process group has {dist.get_world_size()} ranks but the trainer "
                f"was given world_size={world_size}; pass the group's size"
            )
        return
    if "MASTER_PORT" not in os.environ and world_size > 1:
        raise ValueError(
            "MASTER_PORT is not set: start trainers through WorkerGroup, or set "
            "MASTER_ADDR/MASTER_PORT (and RANK/WORLD_SIZE) in every trainer process"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # rank 0's store listens on MASTER_ADDR only (torch's own would take every interface)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", 0))  # serve(port=0): a free one
    open_store = rendezvous.serve if rank == 0 else rendezvous.connect
    store = open_store(host, port, world_size, STORE_TIMEOUT_S)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None,
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a Hugging Face causal LM (``model.model.layers``;
    a vision-language model's ``model.model.language_model.layers``)."""
    body = getattr(model, "model", None)
    layers = getattr(getattr(body, "language_model", body), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no model.layers ModuleList; PolicyTrainer supports "
            "decoder-only Hugging Face causal LMs (Llama, Qwen2, Mistral...)"
        )
    return layers


def vision_tower(model: nn.Module) -> nn.Module | None:
    """A vision-language model's vision tower (Qwen2-VL's ``model.model.visual``: patch
    embedding, ``blocks``, the merger that projects into the language model); None for a
    text-only model."""
    return getattr(getattr(model, "model", None), "visual", None)


COMPILE_FORMS = 64
"""Graphs the compiled layers may build (torch's ``recompile_limit``, 8 by default). Every form
of call is a graph of its own, built once: grad mode, checkpointing's recomputation, a
reference's frozen parameters, a micro-batch of one row (torch specialises sizes of 1). A policy
with a reference and one-row micro-batches already builds 8; past the limit a new form would
run eagerly, unsaid."""


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` every decoder layer in place (``nn.Module.compile``: the module tree,
    parameter names and state dicts stay as they are), before checkpointing wraps the layers
    and FSDP2 shards them, so the wrapper's recomputation and FSDP2's hooks stay outside the
    compiled code. The layers share one compiled graph per kind of call (a forward without
    autograd in train and in eval mode, a forward and its backward), their parameters passed as
    inputs; ``dynamic=True`` compiles for any batch and sequence length at once, where the
    default compiles the first shape statically and then once more for the next length."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, COMPILE_FORMS)
    if "TORCH_LOGS" not in os.environ:  # why a graph compiles again: to the run's console log
        torch._logging.set_logs(recompiles=True)


COMPILE_TIMER = "_compile.compile_inner"
"""torch's timer of a frame's compilation: Dynamo, AOTAutograd and Inductor, the backward
graph included where torch builds it with the forward (2.13 does; one built lazily at the first
backward would not count)."""


def compile_counts() -> tuple[int, float]:
    """The graphs ``torch.compile`` has built in this process so far and the seconds it spent
    building them (``compile_layers``: a compiled step that builds none runs what it built)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(compilation_time_metrics.get(COMPILE_TIMER, ()))
    return int(counters["stats"]["unique_graphs"]), float(seconds)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wrap every decoder layer, and a vision tower's blocks (an image of 1024 patches through
    32 blocks keeps more activations than its rows' text), so backward recomputes their
    activations. torch's wrapper strips its ``_checkpoint_wrapped_module.`` prefix from state
    dicts (plain and DCP), so parameter names stay Hugging Face names and checkpoints load with
    or without it.

    Decoder layers take torch's reentrant checkpoint: its forward runs without autograd and
    saves nothing, where the non-reentrant one passes every tensor a layer saves through Python
    hooks, twice (28 layers: 45k of 140k Python calls a micro-batch; the same numbers). It gives
    a layer's parameters gradients only through inputs that require them, so the embeddings'
    output is made to (``_inputs_require_grad``: frozen embeddings, as with LoRA). Vision
    blocks the same way, the patch embedding's output made to require them (a frozen tower);
    a tower without a ``patch_embed`` keeps the non-reentrant checkpoint."""
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(
            layer, checkpoint_impl=CheckpointImpl.REENTRANT, checkpoint_fn=_reentrant
        )
    embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]
    embeddings.register_forward_hook(_inputs_require_grad)
    tower = vision_tower(model)
    blocks = getattr(tower, "blocks", None)
    patches = getattr(tower, "patch_embed", None)
    if isinstance(blocks, nn.ModuleList):
        for index, block in enumerate(blocks):
            if patches is None:
                blocks[index] = checkpoint_wrapper(
                    block, checkpoint_impl=CheckpointImpl.NO_REENTRANT
                )
            else:
                blocks[index] = checkpoint_wrapper(
                    block, checkpoint_impl=CheckpointImpl.REENTRANT, checkpoint_fn=_reentrant
                )
    if isinstance(patches, nn.Module):
        patches.register_forward_hook(_inputs_require_grad)


def _reentrant(function: Any, *args: Any) -> Any:
    """torch's reentrant checkpoint while autograd records; a plain call otherwise (a logprob
    pass: nothing to recompute, and no warning that no input requires gradients)."""
    if not torch.is_grad_enabled():
        return function(*args)
    return checkpoint(function, *args, use_reentrant=True)


def _inputs_require_grad(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
    """Forward hook on the input embeddings: their output requires gradients while autograd
    records (the first reentrant checkpoint's input; nothing reads its gradient)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def apply_fsdp(
    root: nn.Module, model: nn.Module, config: PolicyConfig, device: torch.device
) -> DeviceMesh:
    """``fully_shard`` each decoder layer (and a vision tower's blocks, then the tower), then
    ``root`` (which owns embeddings, final norm and LM head, gathered together for the root's
    forward).

    ``model`` may still be on the host: fully_shard moves one layer at a time to ``device`` and
    keeps only its shard, so no rank ever holds the whole model on the device.

    Gradients are summed over ranks, not averaged: losses are normalised by global token or
    sequence counts (see ``tandem.algorithms.losses``), so the per-rank gradients are already
    the addends of the full-batch gradient.

    On one rank (``stays_gathered``) nothing is resharded after a forward or a backward: the
    gathered parameters stay until the trainer's ``reshard``.
    """
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict = {"mesh": mesh}
    if config.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    gathered = stays_gathered(config, mesh.size(), model, device)
    tower = vision_tower(model)
    if tower is not None:  # each vision block, then the rest of the tower (patches, merger)
        blocks: Any = tower.blocks
        for block in blocks:
            fully_shard(block, reshard_after_forward=not gathered, **kwargs)
        fully_shard(tower, reshard_after_forward=not gathered, **kwargs)
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        # the root's backward needs the last layer again right away: keep it gathered
        last = index == len(layers) - 1
        fully_shard(layer, reshard_after_forward=not (gathered or last), **kwargs)
    fully_shard(root, **kwargs)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo has no PREMUL_SUM, NCCL copies SUM zero-copy
            module.set_force_sum_reduction_for_comms(True)
            module.set_reshard_after_backward(not gathered, recurse=False)
    return mesh


def reshard(root: nn.Module) -> None:
    """Frees gathered parameters. A no-grad forward leaves the root (embeddings, LM head) and
    the last layer gathered, since FSDP2 expects the backward that follows training forwards;
    after inference they would otherwise stay resident until the next forward."""
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
