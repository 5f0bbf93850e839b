"""Distribution applied from outside the model (torchtitan style): FSDP2 per decoder layer and
at the root, optional activation checkpointing. Model code never sees torch.distributed."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from tandem.config.models import PolicyConfig


def init_distributed(rank: int, world_size: int, device: torch.device) -> None:
    """Join the trainers' default process group (from the MASTER_ADDR/PORT env vars that the
    worker group sets). A single trainer that needs no FSDP runs without one."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise ValueError("MASTER_PORT is not set: start trainers through WorkerGroup or set it")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        device_id=(device if device.type == "cuda" else None),
    )


def needs_fsdp(config: PolicyConfig, world_size: int) -> bool:
    return world_size > 1 or config.mixed_precision or config.cpu_offload


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers; cannot apply FSDP per layer")
    return layers


class CheckpointedLayer(nn.Module):
    """Recomputes the wrapped layer's activations in backward instead of storing them."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not torch.is_grad_enabled():
            return self.layer(*args, **kwargs)
        return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> None:
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        layers[index] = CheckpointedLayer(layer)


def apply_fsdp(root: nn.Module, model: nn.Module, config: PolicyConfig) -> None:
    """``fully_shard`` each decoder layer, then ``root`` (which owns embeddings, final norm and
    the LM head, gathered together for the root's forward)."""
    kwargs: dict = {}
    if config.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        # the last layer is gathered again by the root's backward right away: keep it
        fully_shard(layer, reshard_after_forward=index < len(layers) - 1, **kwargs)
    fully_shard(root, **kwargs)
