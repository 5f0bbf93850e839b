"""A run's folder: its name under ``logging.run_dir``, its checkpoints (``step_N/`` written
atomically, a ``latest`` pointer), what ``--resume`` needs of it, and the export of a
checkpoint's policy."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tandem.config import DpoConfig, GrpoConfig, SftConfig
from tandem.config.models import CheckpointConfig, LoggingConfig
from tandem.files import atomic_dir
from tandem.logging.metrics import read_metrics

COMPLETE_MARKER = "COMPLETE"


def make_run_dir(logging: LoggingConfig, kind: str, resume: bool) -> Path:
    if logging.name is not None:
        return logging.run_dir / logging.name
    if resume:
        candidates = sorted(
            (
                p
                for p in logging.run_dir.glob(f"{kind}-*")
                if (p / "checkpoints" / "latest").exists()
            ),
            key=lambda p: p.stat().st_mtime,
        )
        if not candidates:
            raise ValueError(f"--resume: no {kind} run with a checkpoint under {logging.run_dir}")
        return candidates[-1]
    return logging.run_dir / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


class Checkpoints:
    """``run/checkpoints/step_N/`` written atomically (temp dir, then rename) plus a ``latest``
    pointer; the previous complete checkpoint stays until the new one is complete."""

    def __init__(self, run_dir: Path, config: CheckpointConfig):
        self.root = run_dir / "checkpoints"
        self.config = config

    def due(self, step: int, last_step: int) -> bool:
        if not self.config.enabled:
            return False
        return step == last_step or (self.config.every > 0 and step % self.config.every == 0)

    def save(self, step: int, runtime: Any, state: dict[str, Any]) -> Path:
        final = self.root / f"step_{step}"
        with atomic_dir(final, hidden=True) as tmp:  # hidden: _prune's step_* never sees it
            runtime.save_checkpoint(str((tmp / "trainer").resolve()))
            (tmp / "driver_state.json").write_text(json.dumps({"step": step, **state}))
            (tmp / COMPLETE_MARKER).touch()
        pointer = self.root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.root / "latest")
        self._prune()
        return final

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / COMPLETE_MARKER).exists() else None

    def load(self, runtime: Any) -> dict[str, Any]:
        path = self.latest()
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint under {self.root}")
        runtime.load_checkpoint(str((path / "trainer").resolve()))
        return dict(json.loads((path / "driver_state.json").read_text()))

    def _prune(self) -> None:
        done = sorted(
            (p for p in self.root.glob("step_*") if (p / COMPLETE_MARKER).exists()),
            key=lambda p: int(p.name.split("_")[1]),
        )
        for old in done[: -self.config.keep]:
            shutil.rmtree(old, ignore_errors=True)


def check_run_dir(config: GrpoConfig | SftConfig | DpoConfig, kind: str, resume: bool) -> None:
    """Checked before anything starts: ``--resume`` finds a complete checkpoint to continue; a
    fresh run named by ``logging.name`` does not write into a folder that holds another run
    (its steps would follow the old ones in ``metrics.jsonl``, beside the old checkpoints)."""
    run_dir = make_run_dir(config.logging, kind, resume)
    if resume:
        if Checkpoints(run_dir, config.checkpoint).latest() is None:
            raise ValueError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
        return
    earlier = [name for name in ("metrics.jsonl", "checkpoints") if (run_dir / name).exists()]
    if earlier:
        raise ValueError(
            f"logging.name={config.logging.name}: {run_dir} holds an earlier run "
            f"({', '.join(earlier)}); continue it with --resume, or give another logging.name"
        )


def truncate_metrics(run_dir: Path, after_step: int) -> None:
    """On resume, drop metrics logged after the checkpoint (they will be recomputed)."""
    records = [r for r in read_metrics(run_dir) if r["step"] <= after_step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def export_checkpoint(checkpoint: Path, out_dir: Path, merge: bool = False) -> Path:
    """The policy of ``checkpoint`` (a run folder: its latest checkpoint; or its
    ``checkpoints/step_N``) as a Hugging Face folder at ``out_dir``, in this process (no Ray):
    the policy section of the run's resolved config rebuilds the model the shards belong to.
    A LoRA run's policy is a peft adapter folder, or with ``merge`` a model folder of the
    weights with the adapters merged in (transformers and vLLM load it as any model)."""
    from tandem.config.models import PolicyConfig
    from tandem.trainer.policy_trainer import PolicyTrainer

    step_dir = checkpoint
    if (checkpoint / "checkpoints").is_dir():
        latest = Checkpoints(checkpoint, CheckpointConfig()).latest()
        if latest is None:
            raise ValueError(f"{checkpoint}: no complete checkpoint under checkpoints/")
        step_dir = latest
    if not (step_dir / COMPLETE_MARKER).exists():
        raise ValueError(
            f"{checkpoint} is not a complete checkpoint (a run folder, or its "
            "checkpoints/step_N holding a COMPLETE marker)"
        )
    resolved = step_dir.parent.parent / "config.json"
    if not resolved.is_file():
        raise ValueError(f"{resolved} not found: the run's resolved config says which model")
    policy = PolicyConfig.model_validate(json.loads(resolved.read_text())["policy"])
    trainer = PolicyTrainer(policy, device="cpu", trainable=False)
    trainer.load_checkpoint(step_dir / "trainer")
    trainer.export_hf(out_dir, merged=merge)
    return out_dir
