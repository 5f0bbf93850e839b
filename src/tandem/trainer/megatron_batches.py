"""The rows each rank of a Megatron trainer computes on.

The runtime gives every trainer rank its own 1/n of a batch (the trainer contract, the same for
FSDP2). Ranks of one tensor/pipeline-parallel group must run the same rows, so the group joins
its members' shards (in rank order) and each rank answers for the rows it was given. With no
model parallelism (one rank per group) the batch is used as it is.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tandem.data.batch import TrainBatch


def join_model_parallel(batch: TrainBatch, group: Any) -> tuple[TrainBatch, slice]:
    """(the group's rows, this rank's rows among them)."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return batch, slice(0, batch.num_sequences)
    if batch.images is not None:
        raise ValueError("policy.backend=megatron trains text batches only (no image prompts)")
    shards: list[Any] = [None] * size
    dist.all_gather_object(shards, batch, group=group)
    start = sum(s.num_sequences for s in shards[: dist.get_rank(group)])
    return concatenate(shards), slice(start, start + batch.num_sequences)


def concatenate(batches: list[TrainBatch]) -> TrainBatch:
    """Rows of ``batches`` one after another, right-padded with zeros to the widest."""
    width = max(b.input_ids.shape[1] for b in batches)
    joined: dict[str, Any] = {}
    for field in fields(TrainBatch):
        parts = [getattr(b, field.name) for b in batches]
        if field.name == "images" or any(p is None for p in parts):
            continue
        joined[field.name] = torch.cat([F.pad(p, (0, width - p.shape[1])) for p in parts])
    return TrainBatch(**joined)
