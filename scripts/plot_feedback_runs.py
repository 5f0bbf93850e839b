"""The curves of ``grpo_arithmetic_feedback`` runs (docs/figures/arithmetic_feedback.png).

With two tries (reward 1 on the first, 0.5 on the second) the logged metrics give the try that
solved a problem: training first-try share = 2 - ``env/turns_mean``; held-out greedy first try
= 2 * ``eval/reward_mean`` - ``eval/accuracy``, second try = the rest of ``eval/accuracy``.

Usage: ``python scripts/plot_feedback_runs.py OUT.png RUN_DIR [RUN_DIR ...]`` (one line per run,
labelled by the run's seed); prints the held-out table as markdown.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _records(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _seed(run: Path) -> int:
    return int(json.loads((run / "config.json").read_text())["algorithm"]["seed"])


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def _held_out(records: list[dict[str, Any]]) -> list[tuple[int, float, float, float]]:
    """(step, solved, first try, second try given a wrong first) of each evaluation."""
    rows = []
    for r in records:
        if "eval/accuracy" in r:
            solved, reward = r["eval/accuracy"], r["eval/reward_mean"]
            first = 2 * reward - solved
            rows.append((r["step"], solved, first, (solved - first) / max(1e-9, 1 - first)))
    return rows


def main(out: Path, runs: list[Path]) -> None:
    fig, (train, held) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    print("| seed | step | solved (2 tries) | first try | second try, first wrong |")
    print("|---|---|---|---|---|")
    for run in runs:
        records, seed = _records(run), _seed(run)
        steps, reward = _series(records, "train/reward_mean")
        train.plot(steps, reward, "-", label=f"reward, seed {seed}")
        steps, turns = _series(records, "env/turns_mean")
        train.plot(steps, [2 - t for t in turns], ":", label=f"first-try share, seed {seed}")
        rows = _held_out(records)
        steps = [r[0] for r in rows]
        held.plot(steps, [r[2] for r in rows], "o-", label=f"first try, seed {seed}")
        held.plot(steps, [r[3] for r in rows], "s--", label=f"2nd try if 1st wrong, seed {seed}")
        for step, solved, first, second in rows:
            print(f"| {seed} | {step} | {solved:.3f} | {first:.3f} | {second:.3f} |")
    train.set_title("training (sampled, T=1): 32 problems x 8 episodes a step")
    held.set_title("held-out greedy: 128 problems")
    for ax in (train, held):
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
