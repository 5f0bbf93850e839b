"""Trainer checkpoints: model + optimizer state with torch.distributed.checkpoint (DCP; every rank
writes its own shards, and a checkpoint loads on any number of ranks), the scheduler, step and
caller's extra state beside them, and per-rank RNG states.

Layout of ``<path>/``: ``shards/`` (DCP), ``rng_rank<r>.pt``, ``trainer_state.json`` (written
last: its presence marks a complete checkpoint). A checkpoint is written into ``<path>.tmp`` and
renamed once every rank is done; a previous ``<path>`` is renamed to ``<path>.old`` first and
removed after, so at every instant one complete checkpoint exists at ``<path>`` or ``<path>.old``
and ``load`` finds it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

if TYPE_CHECKING:
    from tandem.trainer.policy_trainer import PolicyTrainer

STATE_FILE = "trainer_state.json"


def _collective(trainer: PolicyTrainer) -> bool:
    return trainer.uses_fsdp and dist.is_initialized()


def _barrier(trainer: PolicyTrainer) -> None:
    if _collective(trainer):
        dist.barrier()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _states(trainer: PolicyTrainer) -> tuple[dict[str, Any], list[torch.optim.Optimizer]]:
    optimizers = [trainer.optimizer] if trainer.optimizer is not None else []
    model_state, optim_state = get_state_dict(trainer.model, optimizers)
    state: dict[str, Any] = {"model": model_state}
    if optimizers:
        state["optim"] = optim_state
    return state, optimizers


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _dcp(action: Any, trainer: PolicyTrainer, state: dict[str, Any], where: Path) -> None:
    with warnings.catch_warnings():
        # one process without a group is a supported DCP mode; its warning is noise here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        action(state, checkpoint_id=str(where), no_dist=not _collective(trainer))


def save(trainer: PolicyTrainer, path: Path, extra: dict[str, Any]) -> None:
    """See the module docstring. A collective under FSDP2."""
    try:
        json.dumps(extra)
    except TypeError as error:
        raise ValueError(f"checkpoint extra state must be JSON-serialisable: {error}") from None
    tmp = _sibling(path, ".tmp")
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        tmp.mkdir(parents=True)
    _barrier(trainer)
    state, _ = _states(trainer)
    _dcp(dcp.save, trainer, state, tmp / "shards")
    torch.save(_rng_state(), tmp / f"rng_rank{trainer.rank}.pt")
    _barrier(trainer)
    if trainer.rank == 0:
        scheduler = trainer.scheduler.state_dict() if trainer.scheduler is not None else None
        record = {
            "step": trainer.step,
            "world_size": trainer.world_size,
            "scheduler": scheduler,
            "extra": extra,
        }
        (tmp / STATE_FILE).write_text(json.dumps(record))
        _publish(tmp, path)
    _barrier(trainer)


def _publish(tmp: Path, path: Path) -> None:
    old = _sibling(path, ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def complete(path: Path) -> Path | None:
    """The complete checkpoint at ``path``, or the previous one a save that died between its
    two renames left at ``<path>.old``; None if neither is complete."""
    for candidate in (path, _sibling(path, ".old")):
        if (candidate / STATE_FILE).exists():
            return candidate
    return None


def load(trainer: PolicyTrainer, path: Path) -> dict[str, Any]:
    """Restores model, optimizer, scheduler, step and this rank's RNG; returns the extra state."""
    found = complete(path)
    if found is None:
        raise ValueError(f"{path} holds no complete trainer checkpoint (no {STATE_FILE})")
    state, optimizers = _states(trainer)
    _dcp(dcp.load, trainer, state, found / "shards")
    set_state_dict(
        trainer.model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    record = json.loads((found / STATE_FILE).read_text())
    trainer.step = int(record["step"])
    if trainer.scheduler is not None and record["scheduler"] is not None:
        trainer.scheduler.load_state_dict(record["scheduler"])
    rng_file = found / f"rng_rank{trainer.rank}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return dict(record["extra"])
