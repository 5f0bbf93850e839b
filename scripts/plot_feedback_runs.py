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


def _config(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / "config.json").read_text()))


def _mean10(values: list[float]) -> list[float]:
    """The mean of each value and the nine before it (fewer at the start)."""
    return [
        sum(values[max(0, i - 9) : i + 1]) / len(values[max(0, i - 9) : i + 1])
        for i in range(len(values))
    ]


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
        records, config = _records(run), _config(run)
        seed = config["algorithm"]["seed"]
        steps, reward = _series(records, "train/reward_mean")
        line = train.plot(steps, reward, "-", alpha=0.35, label=f"reward, seed {seed}")[0]
        train.plot(steps, _mean10(reward), "-", color=line.get_color(), label="  its 10-step mean")
        rows = _held_out(records)
        steps = [r[0] for r in rows]
        held.plot(steps, [r[2] for r in rows], "o-", label=f"first try, seed {seed}")
        held.plot(steps, [r[3] for r in rows], "s--", label=f"2nd try if 1st wrong, seed {seed}")
        for step, solved, first, second in rows:
            print(f"| {seed} | {step} | {solved:.3f} | {first:.3f} | {second:.3f} |")
    algorithm = config["algorithm"]
    train.set_title(
        f"training reward (sampled, T=1; {algorithm['prompts_per_step']} problems x "
        f"{algorithm['num_generations']} episodes a step)"
    )
    held.set_title(f"held-out, greedy ({config['data']['num_eval_prompts']} problems)")
    train.set_ylim(0.15, 0.55)  # zoomed: the reward moves by a few hundredths
    held.set_ylim(-0.02, 0.7)
    for ax in (train, held):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
