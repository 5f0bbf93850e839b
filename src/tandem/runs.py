"""A run's folder: its name under ``logging.run_dir``, its checkpoints (``step_N/`` written
atomically, a ``latest`` pointer), what ``--resume`` needs of it, and the export of a
checkpoint's policy."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tandem.config import DpoConfig, GrpoConfig, SftConfig
from tandem.config.models import CheckpointConfig, LoggingConfig
from tandem.files import atomic_dir, remove_dir, sibling
from tandem.interrupts import received
from tandem.logging.metrics import read_metrics

COMPLETE_MARKER = "COMPLETE"
MANIFEST = "manifest.json"
"""Each checkpoint's files and their sizes, written last before ``COMPLETE``: a file truncated
or lost afterwards (a copy, a full disk, a hand) shows as damage before anything loads it."""

DISK_FULL_BYTES = 16 * 2**20
"""A checkpoint whose write failed with less free space than this left on its filesystem failed
because the disk is full (torch's writers do not say so: "unexpected pos ...")."""

DAMAGED_PREFIX = "damaged_"
"""A checkpoint ``--resume`` found damaged is moved aside to ``damaged_step_N``: kept for a look,
no longer counted among the checkpoints kept, loaded or pruned."""

_log = logging.getLogger(__name__)


def make_run_dir(logging: LoggingConfig, kind: str, resume: bool) -> Path:
    if logging.name is not None:
        return logging.run_dir / logging.name
    if resume:
        candidates = sorted(
            (
                p
                for p in logging.run_dir.glob(f"{kind}-*")
                if Checkpoints(p, CheckpointConfig()).complete()
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
            try:
                runtime.save_checkpoint(str((tmp / "trainer").resolve()))
            except BaseException as err:  # DCP's CheckpointException is a BaseException
                # torch's writers report a full disk in words of their own
                free = shutil.disk_usage(tmp).free
                interrupt = received()  # DCP rewords an interrupt inside it, too
                if interrupt is not None and not isinstance(err, KeyboardInterrupt):
                    raise interrupt from None
                if isinstance(err, KeyboardInterrupt | SystemExit) or free >= DISK_FULL_BYTES:
                    raise
                raise OSError(
                    errno.ENOSPC,
                    f"No space left on device for checkpoint {final.name} ({free} bytes free; "
                    "the previous checkpoint is intact)",
                    str(self.root),
                ) from err
            (tmp / "driver_state.json").write_text(json.dumps({"step": step, **state}))
            files = (p for p in tmp.rglob("*") if p.is_file())
            sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in files}
            (tmp / MANIFEST).write_text(json.dumps(sizes))
            (tmp / COMPLETE_MARKER).touch()
        pointer = self.root / "latest.tmp"
        try:
            pointer.write_text(final.name)
            os.replace(pointer, self.root / "latest")
        except BaseException:  # a Ctrl-C between the two leaves no latest.tmp behind
            pointer.unlink(missing_ok=True)
            raise
        self._prune()
        return final

    def complete(self) -> list[Path]:
        """The complete checkpoints (``COMPLETE`` written), newest first. The ``latest``
        pointer is not needed: a save that died between its rename and the pointer's left a
        complete checkpoint newer than the pointer says."""
        found = [p for p in self.root.glob("step_*") if (p / COMPLETE_MARKER).is_file()]
        return sorted(found, key=_step_number, reverse=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint whose files are whole (``damage``)."""
        return next((p for p in self.complete() if damage(p) is None), None)

    def load(self, runtime: Any) -> dict[str, Any]:
        """Loads the newest checkpoint that is whole and loads; one that is damaged is skipped,
        saying so, for the one before it. None usable: a ValueError naming each and why."""
        problems: list[str] = []
        for path in self.complete():
            problem = damage(path)
            if problem is None:
                try:
                    runtime.load_checkpoint(str((path / "trainer").resolve()))
                except Exception as err:  # a damaged shard that kept its size
                    from tandem.cluster.groups import WorkerError

                    if isinstance(err, WorkerError):
                        raise
                    problem = f"loading it failed: {type(err).__name__}: {err}"
            if problem is None:
                if problems:
                    _log.warning(f"--resume: continuing from {path}")
                return dict(json.loads((path / "driver_state.json").read_text()))
            aside = path.with_name(DAMAGED_PREFIX + path.name)
            remove_dir(aside)
            os.replace(path, aside)
            _log.warning(
                f"--resume: checkpoint {path} is damaged ({problem}); moved to {aside.name}, "
                "trying the one before"
            )
            problems.append(f"{path.name}: {problem}")
        raise ValueError(
            f"--resume: no usable checkpoint under {self.root}"
            + (f" ({'; '.join(problems)})" if problems else "")
        )

    def _prune(self) -> None:
        """Drops all but the newest ``keep`` complete checkpoints; each is renamed to a hidden
        name first, so a prune cut off half-way never leaves a ``step_N`` with files missing.
        What a killed run left half-written or half-deleted (hidden names) goes too. A Ctrl-C
        or SIGTERM in the middle still ends the sweep of hidden names (``finally``; the
        interrupt handler ignores the signals after the first), so an interrupted run leaves
        none behind."""
        try:
            for old in self.complete()[self.config.keep :]:
                doomed = sibling(old, ".del", hidden=True)
                remove_dir(doomed)
                os.replace(old, doomed)
                remove_dir(doomed)
        finally:
            for leftover in self.root.glob(".step_*"):
                remove_dir(leftover)


def _step_number(path: Path) -> int:
    suffix = path.name.removeprefix("step_")
    return int(suffix) if suffix.isdigit() else -1


def damage(path: Path) -> str | None:
    """What is wrong with the complete checkpoint ``path``, or None: its driver state parses,
    and every file of its manifest is there at the size it was written (older checkpoints have
    no manifest; their trainer state file must exist)."""
    try:
        state = json.loads((path / "driver_state.json").read_text())
    except (OSError, ValueError) as err:
        return f"driver_state.json: {err}"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return "driver_state.json holds no step"
    manifest = path / MANIFEST
    try:
        sizes = json.loads(manifest.read_text()) if manifest.exists() else {}
    except (OSError, ValueError) as err:
        return f"{MANIFEST}: {err}"
    if not sizes and not (path / "trainer" / "trainer_state.json").is_file():
        return "trainer/trainer_state.json is missing"
    for name, size in sizes.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def check_run_dir(config: GrpoConfig | SftConfig | DpoConfig, kind: str, resume: bool) -> None:
    """Checked before anything starts: ``--resume`` finds a complete checkpoint to continue; a
    fresh run named by ``logging.name`` does not write into a folder that holds another run
    (its steps would follow the old ones in ``metrics.jsonl``, beside the old checkpoints)."""
    check_output_paths(config)
    run_dir = make_run_dir(config.logging, kind, resume)
    if resume:
        check_resumed_config(config, run_dir)
        checkpoints = Checkpoints(run_dir, config.checkpoint)
        if checkpoints.latest() is None:
            damaged = [f"{p.name}: {damage(p)}" for p in checkpoints.complete()]
            if not damaged:
                raise ValueError(f"--resume: no complete checkpoint under {checkpoints.root}")
            raise ValueError(
                f"--resume: no usable checkpoint under {checkpoints.root} ({'; '.join(damaged)})"
            )
        return
    earlier = [name for name in ("metrics.jsonl", "checkpoints") if (run_dir / name).exists()]
    if earlier:
        raise ValueError(
            f"logging.name={config.logging.name}: {run_dir} holds an earlier run "
            f"({', '.join(earlier)}); continue it with --resume, or give another logging.name"
        )


def check_output_paths(config: GrpoConfig | SftConfig | DpoConfig) -> None:
    """The folders the run writes are folders, and not the model it trains."""
    if config.logging.run_dir.exists() and not config.logging.run_dir.is_dir():
        raise ValueError(f"logging.run_dir={config.logging.run_dir} is a file, not a folder")
    output_dir = getattr(config, "output_dir", None)
    if output_dir is None:
        return
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output_dir={output_dir} is a file, not a folder")
    if output_dir.resolve() == config.policy.model_path.resolve():
        raise ValueError(
            f"output_dir={output_dir} is policy.model_path: the export would replace the model "
            "being trained; give another folder"
        )


RESUMABLE = (
    "algorithm.num_steps",
    "algorithm.eval_every",
    "data.num_eval_prompts",
    "data.num_eval_pairs",
    "data.reward",
    "data.num_reward_workers",
    "data.reward_timeout_s",
    "data.invalid_reward",
    "logging.",
    "checkpoint.",
    "cluster.",
    "policy.offload_weights",
    "generation.backend",
    "generation.tensor_parallel_size",
    "generation.kv_cache_bytes",
    "generation.gpu_memory_utilization",
    "generation.sleep_level",
    "generation.enforce_eager",
    "generation.compile",
    "refit.timeout_s",
    "refit.bucket_bytes",
    "refit.logprob_mismatch_alarm",
    "environment.step_timeout_s",
    "output_dir",
)
"""Keys (a trailing dot: every key of a section) that ``--resume`` accepts with a value other
than the saved one: how long, how often, where and on what the run goes on, not what it
trains; and the reward, whose code changes under an unchanged key anyway (a run stopped by a
reward's bug goes on with the fixed one). docs/errors.md lists them."""


def check_resumed_config(config: GrpoConfig | SftConfig | DpoConfig, run_dir: Path) -> None:
    """A resumed run trains what its checkpoint was trained with: each key of the run's saved
    ``config.json`` outside ``RESUMABLE`` has its saved value (keys on one side only, from
    another version of tandem, are not compared)."""
    saved_file = run_dir / "config.json"
    if not saved_file.is_file():
        return
    try:
        saved = _flatten(json.loads(saved_file.read_text()))
    except ValueError as err:
        raise ValueError(f"--resume: {saved_file} is not valid JSON ({err})") from None
    new = _flatten(config.model_dump(mode="json"))
    changed = [
        f"  {key}: {saved[key]} -> {new[key]}"
        for key in sorted(saved.keys() & new.keys())
        if not key.startswith(RESUMABLE) and not _same(key, saved[key], new[key])
    ]
    if changed:
        raise ValueError(
            f"--resume: {len(changed)} key(s) differ from the run's saved config "
            f"({saved_file}); a resumed run keeps them (start a new run, or set them back):\n"
            + "\n".join(changed)
        )


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or not data:
        return {prefix.removesuffix("."): data}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def _same(key: str, old: Any, new: Any) -> bool:
    """Equal values; a path given relative once and absolute once is the same path."""
    if old == new:
        return True
    path_keys = ("policy.model_path", "data.train_path", "data.eval_path")
    if key.endswith(path_keys) and isinstance(old, str) and isinstance(new, str):
        return Path(old).resolve() == Path(new).resolve()
    return False


def truncate_metrics(run_dir: Path, after_step: int) -> None:
    """On resume, drop metrics logged after the checkpoint (they will be recomputed)."""
    records = [r for r in read_metrics(run_dir) if r["step"] <= after_step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def check_export_target(out_dir: Path) -> None:
    """``out_dir`` is replaced whole: only an empty folder or an earlier export may be there."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file; give a folder to export to")
    exported = any((out_dir / name).is_file() for name in ("config.json", "adapter_config.json"))
    if out_dir.is_dir() and any(out_dir.iterdir()) and not exported:
        raise ValueError(
            f"{out_dir} holds files and is not a Hugging Face model folder: the export replaces "
            "its folder whole; give an empty or new folder"
        )


def export_checkpoint(checkpoint: Path, out_dir: Path, merge: bool = False) -> Path:
    """The policy of ``checkpoint`` (a run folder: its latest checkpoint; or its
    ``checkpoints/step_N``) as a Hugging Face folder at ``out_dir``, in this process (no Ray):
    the policy section of the run's resolved config rebuilds the model the shards belong to.
    A LoRA run's policy is a peft adapter folder, or with ``merge`` a model folder of the
    weights with the adapters merged in (transformers and vLLM load it as any model)."""
    from tandem.config.models import PolicyConfig

    check_export_target(out_dir)
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
