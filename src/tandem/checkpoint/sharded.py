"""Trainer checkpoints: sharded model + optimizer state with torch.distributed.checkpoint (each
rank writes its own shards), the scheduler and step beside them, and Hugging Face export.

A checkpoint is written into ``<path>.tmp`` and renamed to ``<path>`` once every rank is done,
so ``<path>`` is either complete or absent.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

if TYPE_CHECKING:
    from tandem.trainer.policy_trainer import PolicyTrainer

HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _barrier(trainer: PolicyTrainer) -> None:
    if trainer.distributed and dist.is_initialized():
        dist.barrier()


def save(trainer: PolicyTrainer, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(trainer)
    optimizers = [trainer.optimizer] if trainer.optimizer is not None else []
    model_state, optim_state = get_state_dict(trainer.model, optimizers)
    dcp.save(
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(tmp / "shards"),
        no_dist=not (trainer.distributed and dist.is_initialized()),
    )
    if trainer.rank == 0:
        extra = {"step": trainer.step}
        if trainer.scheduler is not None:
            extra["scheduler"] = trainer.scheduler.state_dict()
        torch.save(extra, tmp / "trainer_state.pt")
    _barrier(trainer)
    if trainer.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    _barrier(trainer)


def load(trainer: PolicyTrainer, path: Path) -> None:
    if not (path / "trainer_state.pt").exists():
        raise ValueError(f"{path} is not a complete trainer checkpoint (no trainer_state.pt)")
    optimizers = [trainer.optimizer] if trainer.optimizer is not None else []
    model_state, optim_state = get_state_dict(trainer.model, optimizers)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(
        state,
        checkpoint_id=str(path / "shards"),
        no_dist=not (trainer.distributed and dist.is_initialized()),
    )
    set_state_dict(
        trainer.model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    extra = torch.load(path / "trainer_state.pt", weights_only=True)
    trainer.step = int(extra["step"])
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(extra["scheduler"])


def export_hf(trainer: PolicyTrainer, path: Path) -> None:
    """A Hugging Face folder (config, safetensors, tokenizer) of the current weights, loadable
    by transformers and vLLM. A collective under FSDP; rank 0 writes."""
    weights = {name: t.cpu().contiguous() for name, t in trainer.iter_weights()}
    if trainer.rank != 0:
        return
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.lm.config.save_pretrained(tmp)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    source = Path(trainer.config.model_path)
    for name in HF_SIDE_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, tmp / name)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
