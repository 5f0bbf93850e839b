"""tandem against TRL's GRPOTrainer on this CPU machine, same work, runs alternating.

Workloads (``--workloads``, default short and long):

- ``short``: the embedded 0.8M-parameter model on the arithmetic task, 8 prompts x 8, <= 8 tokens,
  exact-match reward, 12 steps; also the whole process, start to exit, of both;
- ``main``: the main job's step (``tandem grpo`` with no arguments): the same model and task, 32
  prompts x 8, <= 6 tokens, 12 steps;
- ``long``: a random ~21M-parameter Qwen2 (hidden 512, 6 layers, the embedded tokenizer), 8
  prompts x 8, <= 128 tokens (a random model rarely stops early), the dense digit reward, 5 steps.

Each round runs ``tandem grpo`` (its CLI, the main job's recipe with the workload's overrides,
the default runtime: what a user runs; on this CPU machine trainer and generator in the
driver's process) and ``trl_peer.py`` (in the opposite order every other round) in a
scratch venv the bench builds with uv (TRL 1.16 beside the same torch and transformers as
tandem's lock; TRL is not a tandem dependency). A
run's figure is the median of its steps after the first; one JSON line per run (tandem's with
the medians of its generate, train and refit parts and the runtime its log names), then per
workload the medians over rounds, their spread and the ratio. ``--ray`` adds a third run per
round, ``tandem grpo cluster.runtime=ray`` (colocated Ray actors in their isolated
environments), with its own ratio to TRL.

``--lora RANK`` trains LoRA adapters on both sides instead of every weight: tandem's
``policy.lora`` (rank RANK, alpha 2 x RANK, every linear projection) and TRL's ``GRPOTrainer``
with peft's ``LoraConfig`` of the same rank, alpha and modules; both at 10 x the workload's
learning rate (adapters take a larger one: the ``grpo_arithmetic_lora`` recipe). ``--refit-lora
adapter merged`` runs one tandem side per ``refit.lora`` mode. Every run's line holds the load
average when it ended and its fastest step after the first; on a machine shared with other
jobs the ratio of the fastest steps (``fastest_step_ratio``: the least disturbed step of all
rounds, each side) compares better than the medians.

    ./run.sh python bench/e2e_cpu.py [--workloads short main long] [--rounds 3] [--backend hf]
        [--ray] [--lora 16 [--refit-lora adapter merged]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from ceilings import emit

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TRL_VERSION = "1.16.0"

WORKLOADS = {
    "short": {
        "prompts": 8,
        "steps": 12,
        "max_tokens": 8,
        "reward": "exact_match",
        "lr": 1e-4,
        "model": None,
    },
    "main": {
        "prompts": 32,
        "steps": 12,
        "max_tokens": 6,
        "reward": "exact_match",
        "lr": 1e-4,
        "model": None,
    },
    "long": {
        "prompts": 8,
        "steps": 5,
        "max_tokens": 128,
        "reward": "digit_fraction",
        "lr": 1e-5,
        "model": dict(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
        ),
    },
}
GENERATIONS = 8


def trl_python(root: Path) -> Path:
    """A scratch venv with TRL beside tandem's torch and transformers (built once)."""
    venv = root / f"trl-{TRL_VERSION}"
    python = venv / "bin" / "python"
    if python.exists():
        return python
    env = {**os.environ, "UV_FIND_LINKS": str(ROOT / ".wheels")}
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    pins = [f"torch=={version('torch')}", f"transformers=={version('transformers')}"]
    packages = [*pins, f"trl=={TRL_VERSION}", f"peft=={version('peft')}", "datasets", "accelerate"]
    subprocess.run(
        ["uv", "pip", "install", "-q", "--compile-bytecode", "--python", str(python), *packages],
        check=True,
        env=env,
    )
    return python


def model_path(name: str, root: Path) -> Path:
    from tandem.assets import DEFAULT_MODEL_DIR, write_random_qwen2

    shape = WORKLOADS[name]["model"]
    return DEFAULT_MODEL_DIR if shape is None else write_random_qwen2(root / name, shape)


def prompts_file(model: Path, prompts: int, steps: int, root: Path) -> Path:
    from tandem.config import DataConfig
    from tandem.data.prompts import make_prompt_source

    source = make_prompt_source(DataConfig(), model, lambda *_: 0.0, seed=0)
    path = root / "prompts.jsonl"
    rows = source.train_prompts(0, prompts * steps)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


Run = tuple[float, float, dict[str, float], str, float]
"""A run's median step after the first, whole process seconds, median seconds of the step's
parts, where its workers ran, and its fastest step after the first (the step the machine's
other jobs disturbed least: the figure that compares under load)."""


def learning_rate(name: str, lora: int) -> float:
    return float(WORKLOADS[name]["lr"]) * (10 if lora else 1)  # type: ignore[arg-type]


def lora_overrides(lora: int, refit: str) -> list[str]:
    if not lora:
        return []
    return [f"policy.lora.rank={lora}", f"policy.lora.alpha={2 * lora}", f"refit.lora={refit}"]


def run_tandem(
    name: str, model: Path, root: Path, index: int, backend: str, extra: list[str], lr: float
) -> Run:
    """(median step, whole process seconds, median seconds of the step's parts, where its log
    says the workers ran) of ``tandem grpo`` on the workload with the ``extra`` overrides."""
    work = WORKLOADS[name]
    run_dir = root / "tandem-runs"
    label = f"{name}-{index}-{abs(hash(tuple(extra))) % 10**6}"
    shutil.rmtree(run_dir / label, ignore_errors=True)
    reward = "exact_match" if work["reward"] == "exact_match" else "e2e_rewards:digit_fraction"
    overrides = [
        f"policy.model_path={model}",
        f"generation.backend={backend}",
        f"policy.optimizer.lr={lr}",
        f"algorithm.num_steps={work['steps']}",
        f"algorithm.prompts_per_step={work['prompts']}",
        f"algorithm.num_generations={GENERATIONS}",
        "algorithm.eval_every=0",
        f"generation.sampling.max_tokens={work['max_tokens']}",
        f"data.reward={reward}",
        "checkpoint.enabled=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={run_dir}",
        f"logging.name={label}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    start = time.perf_counter()
    out = subprocess.run(
        [str(Path(sys.executable).with_name("tandem")), "grpo", *overrides],
        env=env,
        capture_output=True,
        text=True,
    )
    whole = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"tandem grpo failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = (run_dir / label / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line][1:]
    parts = {
        part: round(statistics.median(row[f"timing/{part}_s"] for row in rows), 4)
        for part in ("generate", "train", "refit")
    }
    where = next(line for line in out.stderr.splitlines() if line.startswith("workers: "))
    where = where.removeprefix("workers: ").split(" (")[0]
    steps = [row["timing/step_s"] for row in rows]
    return statistics.median(steps), whole, parts, where, min(steps)


def run_trl(
    name: str,
    model: Path,
    prompts: Path,
    python: Path,
    index: int,
    lora: int,
    lr: float,
    extra: tuple[str, ...] = (),
) -> Run:
    """``trl_peer.py`` on the workload (with the ``extra`` arguments) under ``python``."""
    from tandem.config.lora import LINEAR_PROJECTIONS

    work = WORKLOADS[name]
    peft = ["--lora-rank", str(lora), "--lora-alpha", str(2 * lora), "--lora-targets"]
    command = [
        str(python),
        str(BENCH / "trl_peer.py"),
        f"--model={model}",
        f"--prompts={prompts}",
        f"--reward={work['reward']}",
        f"--steps={work['steps']}",
        f"--prompts-per-step={work['prompts']}",
        f"--generations={GENERATIONS}",
        f"--max-tokens={work['max_tokens']}",
        f"--lr={lr}",
        f"--label={name}-{index}",
        *([*peft, *LINEAR_PROJECTIONS] if lora else []),
        *extra,
    ]
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True)
    whole = time.perf_counter() - start
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"figure"')]
    steps = [line["value"] for line in lines if line["figure"] == "trl_step_s"]
    if out.returncode != 0 or not steps:
        raise RuntimeError(f"TRL run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    trained = next(line["value"] for line in lines if line["figure"] == "trl_trainable_params")
    where = f"GRPOTrainer, {trained} trainable parameters"
    return statistics.median(steps[1:]), whole, {}, where, min(steps[1:])


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)]


def tandem_sides(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each tandem side's name and its extra overrides."""
    sides = {}
    for refit in args.refit_lora if args.lora else ["adapter"]:
        suffix = "" if refit == "adapter" else f"_{refit}"
        sides[f"tandem{suffix}"] = lora_overrides(args.lora, refit)
        if args.ray:
            sides[f"tandem_ray{suffix}"] = [*sides[f"tandem{suffix}"], "cluster.runtime=ray"]
    return sides


def run_line(name: str, side: str, index: int, run: Run) -> dict:
    step, whole, parts, where, fastest = run
    return {
        "figure": "e2e_cpu_run",
        "workload": name,
        "side": side,
        "round": index,
        "step_s": round(step, 4),
        "fastest_step_s": round(fastest, 4),
        "process_s": round(whole, 2),
        **({"parts_s": parts} if parts else {}),
        **({"workers": where} if where else {}),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", nargs="+", default=["short", "long"], choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    parser.add_argument(
        "--ray", action="store_true", help="also run tandem with cluster.runtime=ray"
    )
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on both sides (0: off)")
    parser.add_argument(
        "--refit-lora", nargs="+", choices=["adapter", "merged"], default=["adapter"]
    )
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "tandem-e2e-cpu"
    root.mkdir(exist_ok=True)
    python = trl_python(root)
    extras = tandem_sides(args)
    for name in args.workloads:
        model = model_path(name, root)
        prompts = prompts_file(model, WORKLOADS[name]["prompts"], WORKLOADS[name]["steps"], root)
        lr = learning_rate(name, args.lora)
        runs: dict[str, list[Run]] = {side: [] for side in [*extras, "trl"]}
        loads: list[float] = []
        for index in range(args.rounds):
            # every other round runs the sides in the opposite order, so no side always runs
            # first after the peer (or last before it)
            order = list(runs) if index % 2 == 0 else list(runs)[::-1]
            for side in order:
                if side == "trl":
                    run = run_trl(name, model, prompts, python, index, args.lora, lr)
                else:
                    run = run_tandem(name, model, root, index, args.backend, extras[side], lr)
                runs[side].append(run)
                emit(run_line(name, side, index, run))
            loads.append(os.getloadavg()[0])
        step = {side: statistics.median(v[0] for v in values) for side, values in runs.items()}
        whole = {side: statistics.median(v[1] for v in values) for side, values in runs.items()}
        fastest = {side: min(v[4] for v in values) for side, values in runs.items()}
        for side in extras:
            emit(
                {
                    "figure": "e2e_cpu_vs_trl",
                    "workload": name,
                    "tandem_side": side,
                    "lora_rank": args.lora or None,
                    "tandem_backend": args.backend,
                    "tandem_workers": runs[side][0][3],
                    "rounds": args.rounds,
                    "tandem_step_s": round(step[side], 4),
                    "trl_step_s": round(step["trl"], 4),
                    "step_ratio": round(step[side] / step["trl"], 3),
                    "round_ratios": [
                        round(t[0] / r[0], 3) for t, r in zip(runs[side], runs["trl"], strict=True)
                    ],
                    "fastest_step_ratio": round(fastest[side] / fastest["trl"], 3),
                    "tandem_fastest_step_s": round(fastest[side], 4),
                    "trl_fastest_step_s": round(fastest["trl"], 4),
                    "tandem_step_spread": spread([v[0] for v in runs[side]]),
                    "trl_step_spread": spread([v[0] for v in runs["trl"]]),
                    "tandem_process_s": round(whole[side], 2),
                    "trl_process_s": round(whole["trl"], 2),
                    "process_ratio": round(whole[side] / whole["trl"], 3),
                    "load_avg_1m_spread": spread(loads),
                    "cores": len(os.sched_getaffinity(0)),
                }
            )


if __name__ == "__main__":
    main()
