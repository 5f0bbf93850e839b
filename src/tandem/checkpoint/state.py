"""What the checkpoint code saves and restores: plain objects, never the trainer itself (the
trainer builds them; ``checkpoint/`` imports nothing of ``trainer/``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Ranks:
    """The trainer ranks that write one checkpoint or export together."""

    rank: int = 0
    world_size: int = 1
    collective: bool = False
    """Every rank takes part (FSDP2 under a process group): the phases are separated by
    barriers, and each rank writes its own shards."""

    def barrier(self) -> None:
        if self.collective:
            dist.barrier()


@dataclass
class TrainState:
    """A trainer's state as a checkpoint holds it. ``sharded.load`` restores the model,
    optimizer and scheduler in place and sets ``step``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    step: int
    ranks: Ranks = field(default_factory=Ranks)
    model_keys: Callable[[str], bool] | None = None
    """Which entries of the model's state dict a checkpoint holds (None: all); the others keep
    what the model has (LoRA: the adapters only, the frozen base comes from the model folder)."""


ONE_RANK = Ranks()
"""A trainer of one process."""
