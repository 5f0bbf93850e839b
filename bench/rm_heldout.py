"""Held-out pair accuracy of a trained reward model on the embedded task, over every held-out
problem with every wrong answer within 10 (30,821 pairs at the default task: a standard error of
~0.0013 at an accuracy of 0.95, against ~0.02 for a run's 128 held-out pairs). One JSON line:
the accuracy overall and by how far the wrong answer is from the right one.

    ./run.sh python bench/rm_heldout.py <run>/hf [<run>/checkpoints/step_N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from ceilings import emit

from tandem.data.arithmetic import ArithmeticTask
from tandem.trainer.reward_model import STATE_FILE, RewardModel

OFFSETS = [d for d in range(-10, 11) if d != 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a reward model folder (tandem rm's export)")
    parser.add_argument("checkpoint", type=Path, nargs="?", help="a checkpoint of its run")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = RewardModel(args.model)
    if args.checkpoint is not None:
        state = torch.load(args.checkpoint / "trainer" / STATE_FILE, weights_only=False)
        model.model.load_state_dict(state["model"])
    task = ArithmeticTask(seed=0)
    problems = task.eval_prompts(task.num_eval_problems)
    prompts = [p["prompt"] for p in problems]
    right = torch.tensor(model.score(prompts, [p["answer"] for p in problems], batch_size=512))
    wins = total = 0
    by_offset = {}
    for offset in OFFSETS:
        rows = [i for i, p in enumerate(problems) if int(p["answer"]) + offset >= 0]
        wrong = [str(int(problems[i]["answer"]) + offset) for i in rows]
        scores = torch.tensor(model.score([prompts[i] for i in rows], wrong, batch_size=512))
        won = int((right[rows] > scores).sum())
        by_offset[str(offset)] = round(won / len(rows), 3)
        wins, total = wins + won, total + len(rows)
    emit(
        {
            "bench": "rm_heldout",
            "model": str(args.model),
            "checkpoint": str(args.checkpoint) if args.checkpoint else None,
            "problems": len(problems),
            "pairs": total,
            "accuracy": round(wins / total, 4),
            "by_offset": by_offset,
        }
    )


if __name__ == "__main__":
    main()
