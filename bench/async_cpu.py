"""Async GRPO against the synchronous loop on this CPU machine, at equal resources, runs
alternating (sync, async, sync, async, ...).

All run the ``grpo_async`` recipe (split placement, one trainer and one generator, one thread
each) with the same prompts, seeds and steps; the synchronous run sets
``algorithm.max_staleness=0``; each of ``--schedules`` is an async run on that
``algorithm.async_schedule`` (free, fixed_lag); ``--refit-mode`` picks how the async runs' refits
meet a running generation (``algorithm.refit_mode``: after_requests, the default, or in_flight,
which takes the free schedule only). A run's
throughput is its samples (prompts x generations) over the seconds of its steps after the first
(``timing/step_s``: generation, training and refit, not evaluation); its reward curve is
``train/reward_mean`` per step, and the held-out greedy accuracy at the start and the end. One
JSON line per run, then the medians over rounds, their spread, each schedule's speedup over
sync per round (from the same round's runs) and, with both schedules, the share of the free
schedule's speedup that the fixed lag keeps, (fixed / sync - 1) / (free / sync - 1), and
fixed / free (the same round's runs).

    ./run.sh python bench/async_cpu.py [--rounds 2] [--steps 40] [--max-staleness 1]
        [--refit-mode after_requests|in_flight] [--schedules free fixed_lag]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ceilings import emit


def run(mode: str, steps: int, staleness: int, refit_mode: str, root: Path, index: int) -> dict:
    name = f"{mode}-{index}"
    asynchronous = mode != "sync"
    overrides = [
        f"algorithm.max_staleness={staleness if asynchronous else 0}",
        f"algorithm.refit_mode={refit_mode if asynchronous else 'after_requests'}",
        f"algorithm.async_schedule={mode if asynchronous else 'free'}",
        f"algorithm.num_steps={steps}",
        f"algorithm.eval_every={steps}",
        "cluster.env_mode=shared",
        "checkpoint.enabled=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={root}",
        f"logging.name={name}",
    ]
    command = [sys.executable, "-m", "tandem", "grpo", "-c", "grpo_async", *overrides]
    for _ in range(3):  # a loaded machine can time Ray's start out: that run is retried
        out = subprocess.run(command, capture_output=True, text=True)
        if "timed out during startup" not in out.stderr:
            break
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    records = [
        json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in records if "timing/step_s" in r]
    algo = json.loads((root / name / "config.json").read_text())["algorithm"]
    samples = len(train[1:]) * algo["prompts_per_step"] * algo["num_generations"]
    seconds = sum(r["timing/step_s"] for r in train[1:])
    rewards = [round(r["train/reward_mean"], 4) for r in train]
    return {
        "mode": mode,
        "round": index,
        "samples_per_s": samples / seconds,
        "step_s_median": statistics.median(r["timing/step_s"] for r in train[1:]),
        "trainer_idle_s_mean": mean_of(train, "timing/trainer_idle_s"),
        "generator_idle_s_mean": mean_of(train, "timing/generator_idle_s"),
        "staleness_mean": mean_of(train, "async/staleness_mean"),
        "refits": sum(r.get("async/refit", 0.0) for r in train),
        "in_flight_token_frac": mean_of(train, "async/in_flight_token_frac"),
        "reward_first10": statistics.mean(rewards[:10]),
        "reward_last10": statistics.mean(rewards[-10:]),
        "eval_start": records[0].get("eval/accuracy"),
        "eval_end": records[-1].get("eval/accuracy"),
        "rewards": rewards,
    }


def mean_of(records: list[dict], key: str) -> float:
    """Mean of ``key`` over the records (0 where a mode does not log it)."""
    return statistics.mean(r.get(key, 0.0) for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument(
        "--refit-mode", choices=["after_requests", "in_flight"], default="after_requests"
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=["free", "fixed_lag"],
        help="async schedules to run against sync (default: both; free with in_flight refits)",
    )
    args = parser.parse_args()
    if args.schedules is None:
        in_flight = args.refit_mode == "in_flight"
        args.schedules = ["free"] if in_flight else ["free", "fixed_lag"]
    if args.refit_mode == "in_flight" and "fixed_lag" in args.schedules:
        parser.error(
            "--refit-mode in_flight takes --schedules free (a fixed lag refits after requests)"
        )
    results: dict[str, list[dict]] = {mode: [] for mode in ("sync", *args.schedules)}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for index in range(args.rounds):
            for mode in results:
                record = run(
                    mode, args.steps, args.max_staleness, args.refit_mode, Path(tmp), index
                )
                results[mode].append(record)
                emit({"bench": "async_cpu", **record})
    summary: dict[str, float | list[float]] = {}
    for mode, runs in results.items():
        rates = [r["samples_per_s"] for r in runs]
        summary[f"{mode}_samples_per_s_median"] = statistics.median(rates)
        summary[f"{mode}_samples_per_s_spread"] = max(rates) - min(rates)
        summary[f"{mode}_reward_last10_median"] = statistics.median(
            r["reward_last10"] for r in runs
        )
    speedups: dict[str, list[float]] = {}
    for mode in args.schedules:
        pairs = zip(results["sync"], results[mode], strict=True)
        speedups[mode] = [a["samples_per_s"] / s["samples_per_s"] for s, a in pairs]
        summary[f"{mode}_ratio_per_round"] = speedups[mode]
        summary[f"{mode}_ratio_median"] = statistics.median(speedups[mode])
    if len(speedups) == 2:  # the share of the free schedule's speedup the fixed lag keeps
        kept = [
            (fixed - 1) / (free - 1) if free != 1 else float("nan")
            for free, fixed in zip(speedups["free"], speedups["fixed_lag"], strict=True)
        ]
        summary["fixed_lag_kept_per_round"] = kept
        summary["fixed_lag_kept_median"] = statistics.median(kept)
        pairs = zip(results["free"], results["fixed_lag"], strict=True)
        over_free = [fixed["samples_per_s"] / free["samples_per_s"] for free, fixed in pairs]
        summary["fixed_lag_over_free_per_round"] = over_free
        summary["fixed_lag_over_free_median"] = statistics.median(over_free)
    settings = {"max_staleness": args.max_staleness, "refit_mode": args.refit_mode}
    emit({"bench": "async_cpu", "summary": True, **settings, **summary})


if __name__ == "__main__":
    main()
