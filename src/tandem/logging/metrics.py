"""Run observability: a compact console line per step, a rich progress bar, metrics.jsonl,
TensorBoard events, and W&B / MLflow when configured and installed."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tandem.config.models import LoggingConfig
from tandem.logging.console import terminal

CONSOLE_KEYS = {
    "train/loss": "loss",
    "train/reward_mean": "reward",
    "eval/accuracy": "eval_acc",
    "train/kl": "kl",
    "train/clip_frac": "clip",
    "gen/logprob_mismatch": "mismatch",
    "timing/step_s": "step_s",
}
"""Metrics shown on the per-step console line, with their short names."""


class MetricsLogger:
    """Writes each step's metrics to every configured sink. Use as a context manager."""

    def __init__(self, config: LoggingConfig, run_dir: Path, total_steps: int, start_step: int = 0):
        self.run_dir = run_dir
        self.console = Console(file=terminal())
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        self._tensorboard = _tensorboard_writer(run_dir) if config.tensorboard else None
        self._wandb = _wandb_run(config, run_dir)
        self._mlflow = _mlflow_run(config)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not config.progress,
            transient=False,
        )
        self._task = self._progress.add_task("steps", total=total_steps, completed=start_step)

    def __enter__(self) -> MetricsLogger:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, float | int):
                    self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics(
                {k.replace("/", "_"): v for k, v in record.items() if k != "step"}, step=step
            )
        # soft_wrap: one line per step in logs too (not broken at 80 columns off a terminal)
        self._progress.console.print(format_console_line(record), soft_wrap=True)
        self._progress.update(self._task, completed=step)

    def phase(self, name: str) -> None:
        """Show what the step is doing now beside the progress bar (``Runtime.on_phase``)."""
        self._progress.update(self._task, description=f"steps · {name}")

    def info(self, message: str) -> None:
        self._progress.console.print(message)

    def close(self) -> None:
        self._progress.stop()
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def format_console_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']:>4}"]
    for key, short in CONSOLE_KEYS.items():
        value = record.get(key)
        if isinstance(value, float | int) and not math.isnan(value):
            parts.append(f"{short} {value:.3g}")
    return "  ".join(parts)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def _tensorboard_writer(run_dir: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def _wandb_run(config: LoggingConfig, run_dir: Path) -> Any:
    if config.wandb_project is None:
        return None
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(
            "logging.wandb_project is set but wandb is not installed (pip install wandb)"
        )
    import wandb

    return wandb.init(project=config.wandb_project, name=run_dir.name, dir=str(run_dir))


def _mlflow_run(config: LoggingConfig) -> Any:
    if config.mlflow_experiment is None:
        return None
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError(
            "logging.mlflow_experiment is set but mlflow is not installed (pip install mlflow)"
        )
    import mlflow

    mlflow.set_experiment(config.mlflow_experiment)
    mlflow.start_run()
    return mlflow
