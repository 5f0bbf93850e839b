"""On-policy distillation against GRPO on the embedded task: held-out greedy accuracy against
steps for three students from the same starting point (the embedded model):

    grpo      the main job's recipe (exact-match reward)
    distill   the teacher's per-token reverse KL alone (reward.rule_weight=0)
    both      the exact-match reward plus the teacher's term

The teacher is a policy trained by the main job (``--teacher``: its run's ``hf/`` folder; its
held-out accuracy is read from that run's metrics). Each run is ``tandem grpo`` as a user runs
it; ``--existing NAME=RUN_DIR`` reuses a finished run instead (e.g. the teacher's own GRPO run as
the grpo curve); a NAME that is none of the three adds its run's curve (a variant, e.g. another
learning rate), labelled NAME. One JSON line per run (its accuracy at each evaluation and the
first step that reached the teacher's accuracy minus 0.05), then the figure (``--figure``).

    ./run.sh python bench/distillation.py --teacher runs/grpo-X/hf [--steps 60]
        [--existing grpo=runs/grpo-X] [--figure docs/figures/distillation.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ceilings import emit

RUNS = {
    "grpo": [],
    "distill": ["algorithm.teacher={teacher}", "reward.rule_weight=0"],
    "both": ["algorithm.teacher={teacher}"],
}


def accuracy(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]


def train(name: str, teacher: Path, steps: int, root: Path) -> Path:
    overrides = [o.format(teacher=teacher) for o in RUNS[name]]
    command = [
        "tandem", "grpo", *overrides, f"algorithm.num_steps={steps}", "checkpoint.enabled=false",
        "logging.progress=false", f"logging.run_dir={root}", f"logging.name={name}",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return root / name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--root", type=Path, default=Path("runs/distillation"))
    parser.add_argument("--existing", nargs="*", default=[], metavar="NAME=RUN_DIR")
    parser.add_argument("--figure", type=Path, default=Path("docs/figures/distillation.png"))
    args = parser.parse_args()
    existing = dict(item.split("=", 1) for item in args.existing)
    teacher_curve = accuracy(args.teacher.parent)
    target = teacher_curve[-1][1] - 0.05
    curves = {}
    for name in [*RUNS, *(name for name in existing if name not in RUNS)]:
        run = (
            Path(existing[name])
            if name in existing
            else train(name, args.teacher, args.steps, args.root)
        )
        curves[name] = accuracy(run)
        reached = next((step for step, acc in curves[name] if acc >= target), None)
        emit({"bench": "distillation", "run": name, "dir": str(run), "target": round(target, 4),
              "first_step_at_target": reached, "accuracy": curves[name]})  # fmt: skip
    plot(curves, teacher_curve[-1][1], args.figure, args.steps)


def plot(curves: dict, teacher: float, path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    labels = {"grpo": "GRPO (exact match)", "distill": "distillation alone", "both": "both"}
    for name, points in curves.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, "o-", label=labels.get(name, name), markersize=3)
    ax.axhline(teacher, color="grey", linestyle="--", label=f"teacher ({teacher:.2f})")
    ax.axhline(teacher - 0.05, color="grey", linestyle=":", label="teacher - 0.05")
    ax.set_xlim(0, max(steps, max(x for pts in curves.values() for x, _ in pts)))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
