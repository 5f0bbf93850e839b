"""Scoring throughput of the reward-model worker against a plain batched forward of the same
model in one process.

A reward model (``--model``, default: the embedded model with a fresh one-label head) scores
``--samples`` arithmetic (prompt, response) pairs, ``--batch-size`` at a time, on
``--threads`` torch threads, three ways, alternating over ``--rounds``:

    plain    ``RewardModel.score`` called here (the ceiling: no worker, no transport)
    inline   the worker of the in-process runtime (``InlineGroup``), through ``ModelScorers``
    actor    the Ray actor of kind reward_model (shared environment), through ``ModelScorers``

One JSON line per measurement (samples/s), then the medians and each way's ratio to plain.
``--busy N`` keeps N other processes spinning at the default priority while it measures: the
contention of a machine shared with other jobs, made repeatable (each line records the load
average and the actor's niceness).

    ./run.sh python bench/reward_model.py [--samples 1024] [--batch-size 64] [--rounds 3]
        [--busy 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from ceilings import emit

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.scorers import model_scorers
from tandem.config import GrpoConfig, load_config
from tandem.rewards.scorer import Scores
from tandem.trainer.reward_model import RewardModel


def samples(count: int) -> list[tuple[str, str, str]]:
    rng = random.Random(0)
    out = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        out.append((f"{a}+{b}=", str(a + b + rng.choice([0, 0, 1, -1])), str(a + b)))
    return out


def niceness() -> int:
    return os.nice(0)


def spin() -> None:
    while True:
        pass


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    try:
        for process in busy:
            process.start()
        measure(args)
    finally:
        for process in busy:
            process.kill()


def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = Path(tmp) / "rm"
            RewardModel(DEFAULT_MODEL_DIR, seed=0).export_hf(path)
        batch = samples(args.samples)
        prompts, responses = [s[0] for s in batch], [s[1] for s in batch]
        plain = RewardModel(path)
        rule = Scores([0.0] * len(batch))
        results: dict[str, list[float]] = {"plain": [], "inline": [], "actor": []}
        actor_niceness = None
        common = [
            f"reward.model={path}",
            f"reward.batch_size={args.batch_size}",
            "reward.rule_weight=0",
            f"cluster.threads_per_actor={args.threads}",
            "cluster.env_mode=shared",
        ]
        for runtime in ("in_process", "ray"):
            config = load_config(GrpoConfig, None, [*common, f"cluster.runtime={runtime}"])
            with model_scorers(config) as scorers:
                assert scorers is not None
                scorers.score(batch[: args.batch_size], Scores([0.0] * args.batch_size))  # warm
                plain.score(prompts[: args.batch_size], responses[: args.batch_size])
                way = "inline" if runtime == "in_process" else "actor"
                if runtime == "ray":  # a Ray worker's priority, as the actor's
                    import ray

                    actor_niceness = ray.get(ray.remote(num_cpus=0)(niceness).remote())
                for index in range(args.rounds):
                    for name, fn in (
                        ("plain", lambda: plain.score(prompts, responses, args.batch_size)),
                        (way, lambda: scorers.score(batch, rule)),
                    ):
                        rate = len(batch) / timed(fn)
                        results[name].append(rate)
                        emit({"bench": "reward_model", "way": name, "round": index,
                              "samples_per_s": round(rate, 1),
                              "load_avg_1m": os.getloadavg()[0]})  # fmt: skip
        ceiling = statistics.median(results["plain"])
        for name, rates in results.items():
            emit({
                "bench": "reward_model", "way": name, "median_samples_per_s": round(
                    statistics.median(rates), 1), "ratio_vs_plain": round(
                    statistics.median(rates) / ceiling, 3), "samples": args.samples,
                "batch_size": args.batch_size, "threads": args.threads, "busy": args.busy,
                "actor_niceness": actor_niceness,
            })  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
