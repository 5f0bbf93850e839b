"""PNG plots of a run's metrics (reward and held-out accuracies over steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_run(records: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Reward (train), accuracy and preference accuracy (eval) against step, saved as a PNG at
    ``path``."""
    import matplotlib  # (a second's import: not on the way to a config error)

    matplotlib.use("Agg")  # headless: runs on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key, label, style in (
        ("train/reward_mean", "train reward", "-"),
        ("eval/accuracy", "held-out accuracy", "o-"),
        ("eval/preference_accuracy", "held-out preference accuracy", "s--"),
    ):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), float | int)]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, style, label=label)
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
