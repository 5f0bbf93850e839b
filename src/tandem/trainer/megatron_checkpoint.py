"""Checkpoints of the Megatron trainer: per rank its model slice (Megatron names, this stage's
layers, this tensor-parallel rank's slice), the main parameters and Adam state of its
optimizer shard; the step, the layout and the caller's extra state in ``trainer_state.json``
(written last: its presence marks a complete checkpoint), all written into ``<path>.tmp`` and
renamed (``files.atomic_dir``). A checkpoint loads on the layout that wrote it."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.checkpoint.sharded import STATE_FILE, complete
from tandem.files import atomic_dir, sibling

MegatronTrainer = Any
"""(``megatron_trainer.MegatronTrainer``, which imports this module: not imported back.)"""


@dataclass
class Restored:
    step: int
    extra: dict[str, Any]


def _inner(trainer: MegatronTrainer) -> list[Any]:
    return trainer.inner_optimizers()


def save(trainer: MegatronTrainer, path: Path, extra: dict[str, Any]) -> None:
    """A collective: every rank writes ``rank<r>.pt``, rank 0 the state file."""
    json.dumps(extra)  # fails here, before anything is written, if it cannot
    ranks = trainer.ranks()
    staging: contextlib.AbstractContextManager[Path] = (
        atomic_dir(path) if trainer.rank == 0 else contextlib.nullcontext(sibling(path, ".tmp"))
    )
    with staging as tmp:
        ranks.barrier()  # the folder exists before any rank writes
        inner = _inner(trainer)
        state = {
            "model": {k: v for k, v in trainer.model.state_dict().items() if v is not None},
            "optimizers": [opt.state_dict() for opt in inner],
            "main": [[p.detach() for g in o.param_groups for p in g["params"]] for o in inner],
        }
        torch.save(state, tmp / f"rank{trainer.rank}.pt")
        ranks.barrier()
        if trainer.rank == 0:
            record = {
                "step": trainer.step,
                "world_size": trainer.world_size,
                "megatron": trainer.config.megatron.model_dump(),
                "extra": extra,
            }
            (tmp / STATE_FILE).write_text(json.dumps(record))
    ranks.barrier()


@torch.no_grad()
def load(trainer: MegatronTrainer, path: Path) -> Restored:
    found = complete(path)
    if found is None:
        raise ValueError(f"{path} holds no complete trainer checkpoint (no {STATE_FILE})")
    record = json.loads((found / STATE_FILE).read_text())
    layout = trainer.config.megatron.model_dump()
    if record.get("world_size") != trainer.world_size or record.get("megatron") != layout:
        raise ValueError(
            f"{found} was saved by {record.get('world_size')} ranks with "
            f"{record.get('megatron', 'policy.backend=fsdp2')}; this trainer is "
            f"{trainer.world_size} ranks with {layout}: resume on the layout that saved it"
        )
    # our own file (model state may hold extra-state objects): not weights_only
    state = torch.load(
        found / f"rank{trainer.rank}.pt", map_location=trainer.device, weights_only=False
    )
    trainer.model.load_state_dict(state["model"], strict=False)
    inner = _inner(trainer)
    for opt, saved, main in zip(inner, state["optimizers"], state["main"], strict=True):
        params = [p for g in opt.param_groups for p in g["params"]]
        for param, value in zip(params, main, strict=True):
            param.copy_(value)
        opt.load_state_dict(saved)
    return Restored(int(record["step"]), dict(record["extra"]))
