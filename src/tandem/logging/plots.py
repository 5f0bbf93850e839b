"""PNG plots of a run's metrics (reward and held-out accuracies over steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_run(records: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Reward (train), accuracy and preference accuracy (eval) against step, saved as a PNG at
    ``path``; a run that logged none of them (supervised, without evaluation) plots its
    training loss."""
    import matplotlib  # (a second's import: not on the way to a config error)

    matplotlib.use("Agg")  # headless: runs on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    series = (
        ("train/reward_mean", "train reward", "-"),
        ("eval/accuracy", "held-out accuracy", "o-"),
        ("eval/preference_accuracy", "held-out preference accuracy", "s--"),
    )
    corner: Any = "lower right"  # rewards and accuracies rise
    if not any(_plot(ax, records, *line) for line in series):
        _plot(ax, records, "train/loss", "train loss", "-")
        corner = "upper right"  # a loss falls
    else:
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # (an empty legend warns)
        ax.legend(loc=corner)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot(ax: Any, records: list[dict[str, Any]], key: str, label: str, style: str) -> bool:
    """``key`` against step where the records have it; whether they had it."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), float | int)]
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, style, label=label)
    return bool(points)
