"""Trainer checkpoints: model + optimizer state with torch.distributed.checkpoint (DCP; every rank
writes its own shards, and a checkpoint loads on any number of ranks), the scheduler, step and
caller's extra state beside them, and per-rank RNG states.

Layout of ``<path>/``: ``shards/`` (DCP), ``rng_rank<r>.pt``, ``trainer_state.json`` (written
last: its presence marks a complete checkpoint). A checkpoint is written into ``<path>.tmp`` and
renamed once every rank is done (``files.atomic_dir``); a previous ``<path>`` is renamed to
``<path>.old`` first and removed after, so at every instant one complete checkpoint exists at
``<path>`` or ``<path>.old`` and ``load`` finds it.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from tandem.checkpoint.state import TrainState
from tandem.files import atomic_dir, sibling

STATE_FILE = "trainer_state.json"


def _states(state: TrainState) -> tuple[dict[str, Any], list[torch.optim.Optimizer]]:
    optimizers = [state.optimizer] if state.optimizer is not None else []
    model_state, optim_state = get_state_dict(state.model, optimizers)
    if state.model_keys is not None:
        model_state = {k: v for k, v in model_state.items() if state.model_keys(k)}
    states: dict[str, Any] = {"model": model_state}
    if optimizers:
        states["optim"] = optim_state
    return states, optimizers


def _rng_state() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def _dcp(action: Any, state: TrainState, states: dict[str, Any], where: Path) -> None:
    with warnings.catch_warnings():
        # one process without a group is a supported DCP mode; its warning is noise here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        action(states, checkpoint_id=str(where), no_dist=not state.ranks.collective)


@contextlib.contextmanager
def _staging(state: TrainState, path: Path) -> Iterator[Path]:
    """Rank 0 owns the atomic folder; the other ranks write into it."""
    if state.ranks.rank == 0:
        with atomic_dir(path) as tmp:
            yield tmp
    else:
        yield sibling(path, ".tmp")


def save(state: TrainState, path: Path, extra: dict[str, Any]) -> None:
    """See the module docstring. A collective under FSDP2."""
    try:
        json.dumps(extra)
    except TypeError as error:
        raise ValueError(f"checkpoint extra state must be JSON-serialisable: {error}") from None
    ranks = state.ranks
    with _staging(state, path) as tmp:
        ranks.barrier()  # the folder exists before any rank writes
        states, _ = _states(state)
        _dcp(dcp.save, state, states, tmp / "shards")
        torch.save(_rng_state(), tmp / f"rng_rank{ranks.rank}.pt")
        ranks.barrier()
        if ranks.rank == 0:
            scheduler = (
                _plain(state.scheduler.state_dict()) if state.scheduler is not None else None
            )
            record = {
                "step": state.step,
                "world_size": ranks.world_size,
                "scheduler": scheduler,
                "extra": extra,
            }
            (tmp / STATE_FILE).write_text(json.dumps(record))
    ranks.barrier()


def _plain(value: Any) -> Any:
    """``value`` with its tensors as numbers or lists: an optimizer whose learning rate is a
    tensor (torchao's) gives its scheduler tensor learning rates."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def complete(path: Path) -> Path | None:
    """The complete checkpoint at ``path``, or the previous one a save that died between its
    two renames left at ``<path>.old``; None if neither is complete."""
    for candidate in (path, sibling(path, ".old")):
        if (candidate / STATE_FILE).exists():
            return candidate
    return None


def load(state: TrainState, path: Path) -> dict[str, Any]:
    """Restores model, optimizer, scheduler, ``state.step`` and this rank's RNG; returns the
    extra state."""
    found = complete(path)
    if found is None:
        raise ValueError(f"{path} holds no complete trainer checkpoint (no {STATE_FILE})")
    states, optimizers = _states(state)
    _dcp(dcp.load, state, states, found / "shards")
    set_state_dict(
        state.model,
        optimizers,
        model_state_dict=states["model"],
        optim_state_dict=states.get("optim", {}),
        # a partial model state (``model_keys``) leaves the other entries as they are
        options=StateDictOptions(strict=state.model_keys is None),
    )
    record = json.loads((found / STATE_FILE).read_text())
    state.step = int(record["step"])
    if state.scheduler is not None and record["scheduler"] is not None:
        state.scheduler.load_state_dict(record["scheduler"])
    rng_file = found / f"rng_rank{state.ranks.rank}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return dict(record["extra"])
