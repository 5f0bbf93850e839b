"""GRPO end to end on the GPU through the real runtime: Ray actors, colocated placement, the
memory phases (offload/onload, generator sleep/wake), CUDA IPC refit, HF generation.

For each model shape, ``tandem grpo`` runs a few steps on the embedded arithmetic prompts with a
dense reward (``e2e_rewards:digit_fraction``); one JSON line per step gives the breakdown
(generate, train, refit, offload, onload), the trainer's device memory (after its offload, at
rest, its peak during refit) and the generator/trainer logprob mismatch, and one line per shape
the medians of the steps after the first, beside the pinned-copy ceilings of the same run.
Models are random Qwen2s of the 0.5B / 1.5B shapes with the embedded tokenizer (vocabulary 257,
so the LM head is small), fp32 master weights; ``--real-vocab`` takes the real Qwen2.5 shapes
(0.5B / 1.5B / 3B / 7B) with the 151,936-token vocabulary instead (``tandem.assets.real_shapes``),
``--mean-length`` spreads their response lengths (EOS after about that many tokens on average,
up to ``--max-tokens``). Those lines add the train phase's MFU (against the bf16 matmul rate
measured in the same run) and generated tokens/s against the decode roofline (formulas in
``real_scale_figures``).

With ``--trl`` it runs tandem and TRL's ``GRPOTrainer`` (``trl_peer.py``, transformers
generation on both sides) on the same work, alternately, ``--rounds`` times each, and prints the
median step of each run and the ratio tandem / TRL (TRL's ``--bf16`` matches
``--mixed-precision``: fp32 masters, bf16 compute).

``--lora RANK`` trains LoRA adapters instead of every weight, as LoRA usually runs: the frozen
base in bf16 (``policy.dtype=bfloat16``; peft keeps the adapters in fp32), rank RANK, alpha
2 x RANK on every linear projection, learning rate 1e-4; TRL loads the model in bf16 with
peft's ``LoraConfig`` of the same rank, alpha and modules (and ``--bf16``). Each step's line
holds the same lines. Every run's medians' line adds the device's memory in use as sampled
every 20 ms during the run (``torch.cuda.mem_get_info``: every process, the trainer and
generator actors and this driver), its peak and its least.

    PYTHONPATH=.gpu/site:src:bench python bench/e2e_gpu.py [--shapes 0.5b 1.5b] [--steps 6]
        [--mixed-precision] [--kl-coef 0.0] [--trl --rounds 2] [--lora 32] [--set KEY=VALUE ...]

(``.gpu/site``: Ray, pydantic and TRL from ``scripts/offline_bundle.sh`` on a GPU machine without
a network; docs/gpu.md.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from ceilings import emit, measure_ceilings
from real_scale_figures import scale_figures

from tandem.assets import write_random_qwen2
from tandem.assets.real_shapes import QWEN25_SHAPES, real_shape_dir, write_real_shape

PER_STEP = (
    "timing/step_s",
    "timing/generate_s",
    "timing/logprobs_s",
    "timing/train_s",
    "timing/refit_s",
    "timing/policy_offload_s",
    "timing/policy_onload_s",
    "timing/generator_sleep_s",
    "timing/generator_wake_s",
    "memory/trainer_bytes_offloaded",
    "memory/trainer_resident_bytes",
    "memory/trainer_peak_refit_bytes",
    "memory/trainer_alloc_retries",
    "compile/graphs",  # policy.compile: the graphs the step built, and the seconds it took
    "compile/seconds",
    "gen/logprob_mismatch",
    "timing/decode_prefill_s",  # the transformers generator's decode (HfGenerator.take_stats)
    "timing/decode_forward_s",
    "timing/decode_sample_s",
    "timing/decode_bookkeeping_s",
    "timing/decode_compact_s",
    "throughput/decode_steps",
    "throughput/decode_row_steps",
    "throughput/decode_parked",
    "throughput/decode_prefills",
    "train/reward_mean",
    "train/response_len_mean",
    "throughput/tokens_per_s",
)


def run_tandem(path: Path, args: argparse.Namespace, run_dir: Path) -> list[dict[str, Any]]:
    from tandem.config import GrpoConfig, load_config
    from tandem.driver import run_grpo

    # a fresh run: a warm machine keeps /tmp between calls, and a named run's metrics.jsonl
    # would take this run's steps after the last call's
    shutil.rmtree(run_dir / path.name, ignore_errors=True)
    overrides = [
        "cluster.env_mode=shared",
        "generation.backend=hf",
        f"policy.model_path={path}",
        f"policy.mixed_precision={str(args.mixed_precision).lower()}",
        f"policy.micro_batch_size={args.micro_batch_size}",
        f"policy.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        *(
            [f"policy.max_tokens_per_micro_batch={args.max_tokens_per_micro_batch}"]
            if args.max_tokens_per_micro_batch
            else []
        ),
        f"policy.optimizer.lr={learning_rate(args)}",
        *lora_overrides(args),
        f"algorithm.num_steps={args.steps}",
        f"algorithm.prompts_per_step={args.prompts}",
        f"algorithm.num_generations={args.generations}",
        f"algorithm.kl_coef={args.kl_coef}",
        "algorithm.eval_every=0",
        f"generation.sampling.max_tokens={args.max_tokens}",
        "data.reward=e2e_rewards:digit_fraction",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",  # a 7B run's 15 GB export filled a 64 GB disk
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={run_dir}",
        f"logging.name={path.name}",
        *args.overrides,
    ]
    with DeviceMemory() as memory:
        records = run_grpo(load_config(GrpoConfig, "grpo_arithmetic", overrides))
    args.device_memory = memory.figures()
    return records


class DeviceMemory:
    """The device's memory in use (all processes), sampled in a thread while a run lasts."""

    def __init__(self, period: float = 0.02) -> None:
        self.period = period
        self.used: list[int] | None = [] if torch.cuda.is_available() else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            assert self.used is not None
            self.used.append(total - free)
            time.sleep(self.period)

    def __enter__(self) -> DeviceMemory:
        if self.used is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.used is not None:
            self._thread.join()

    def figures(self) -> dict[str, float]:
        if not self.used:
            return {}
        total = torch.cuda.mem_get_info()[1]
        return {
            "device_used_peak_bytes": max(self.used),
            "device_used_least_bytes": min(self.used),
            "device_total_bytes": total,
        }


def learning_rate(args: argparse.Namespace) -> float:
    return 1e-4 if args.lora else 1e-5


def lora_overrides(args: argparse.Namespace) -> list[str]:
    if not args.lora:
        return []
    return [
        f"policy.lora.rank={args.lora}",
        f"policy.lora.alpha={2 * args.lora}",
        "policy.dtype=bfloat16",
    ]


def trl_lora_args(args: argparse.Namespace) -> list[str]:
    from tandem.config.lora import LINEAR_PROJECTIONS

    if not args.lora:
        return ["--bf16"] if args.mixed_precision else []
    lora = ["--lora-rank", str(args.lora), "--lora-alpha", str(2 * args.lora)]
    return [*lora, "--lora-targets", *LINEAR_PROJECTIONS, "--model-dtype=bfloat16", "--bf16"]


def median_step(values: list[float]) -> float:
    """The median of the steps after the first (which carries warm-up)."""
    return statistics.median(values[1:] or values)


def run_trl(path: Path, args: argparse.Namespace, root: Path, label: str) -> float:
    """TRL's median step on the same work, in its own process."""
    from tandem.config import DataConfig
    from tandem.data.prompts import make_prompt_source

    prompts = root / "prompts.jsonl"
    source = make_prompt_source(DataConfig(), path, lambda *_: 0.0, seed=0)
    rows = source.train_prompts(0, args.prompts * args.steps)
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [
        args.trl_python,
        str(Path(__file__).with_name("trl_peer.py")),
        f"--model={path}",
        f"--prompts={prompts}",
        "--reward=digit_fraction",
        f"--steps={args.steps}",
        f"--prompts-per-step={args.prompts}",
        f"--generations={args.generations}",
        f"--max-tokens={args.max_tokens}",
        f"--lr={learning_rate(args)}",
        f"--label={label}",
        f"--micro-batch={args.trl_micro_batch}",
        *trl_lora_args(args),
        *([] if args.activation_checkpointing else ["--no-gradient-checkpointing"]),
    ]
    # its figure lines pass through as they come (a run stopped at its limit still shows the
    # steps TRL finished), its log to a file beside the prompts
    log = root / f"trl-{label}.log"
    lines = []
    with (
        log.open("w") as err,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
    ):
        try:
            for raw in proc.stdout or ():
                if raw.startswith('{"figure"'):
                    lines.append(json.loads(raw))
                    print(raw.rstrip(), flush=True)
        except BaseException:
            proc.kill()
            raise
    steps = [line for line in lines if line["figure"] == "trl_step_s"]
    for line in lines:
        if line["figure"] == "trl_trainable_params":
            emit(line)
    if proc.returncode != 0 or not steps:
        tail = log.read_text()[-3000:]
        memory = "out of memory" if "OutOfMemoryError" in tail else "failed"
        emit({"figure": "trl_failed", "label": label, "why": memory, "rc": proc.returncode})
        raise RuntimeError(f"TRL run failed ({proc.returncode}), {log}:\n{tail}")
    return median_step([r["value"] for r in steps])


def side_by_side(shape: str, path: Path, args: argparse.Namespace, root: Path) -> None:
    """tandem, TRL, tandem, TRL...: the median step of each run, then the ratio of medians."""
    times: dict[str, list[float]] = {"tandem": [], "trl": []}
    for round_index in range(args.rounds):
        records = run_tandem(path, args, root / f"runs-{round_index}")
        emit_breakdown(shape, records, args, round=round_index)
        times["tandem"].append(median_step([r["timing/step_s"] for r in records if r["step"]]))
        times["trl"].append(run_trl(path, args, root, f"{shape}-{round_index}"))
        emit(
            {
                "figure": "e2e_gpu_round",
                "shape": shape,
                "round": round_index,
                **{k: round(v[-1], 3) for k, v in times.items()},
            }
        )
    tandem, trl = statistics.median(times["tandem"]), statistics.median(times["trl"])
    emit(
        {
            "figure": "e2e_gpu_vs_trl",
            "shape": shape,
            "mixed_precision": args.mixed_precision,
            "micro_batch_size": args.micro_batch_size,
            "tandem_step_s": round(tandem, 3),
            "trl_step_s": round(trl, 3),
            "ratio": round(tandem / trl, 3),
            "tandem_runs": [round(v, 3) for v in times["tandem"]],
            "trl_runs": [round(v, 3) for v in times["trl"]],
            "work": f"{args.prompts}x{args.generations}x<={args.max_tokens} tokens",
        }
    )


def emit_breakdown(
    shape: str, records: list[dict[str, Any]], args: argparse.Namespace, **extra: Any
) -> None:
    """One line for each step after the first, then their medians, the worst mismatch and the
    pinned-copy ceilings of this run."""
    setup = {
        "mixed_precision": args.mixed_precision,  # the flag; --set overrides (below) win
        "overrides": args.overrides,
        "kl_coef": args.kl_coef,
        "real_vocab": args.real_vocab,
        "max_tokens": args.max_tokens,
        "mean_length": args.mean_length,
        **extra,
    }
    steps = [r for r in records if r["step"] >= 1] or records
    scale = args.real_vocab and args.ceilings
    for record in steps:
        emit(
            {
                "figure": "e2e_gpu_step",
                "shape": shape,
                **setup,
                "step": record["step"],
                **{k: record.get(k) for k in PER_STEP},
                **(scale_figures(args.paths[shape], record, args) if scale else {}),
            }
        )
    later = steps[1:] or steps
    medians = {k: statistics.median(r.get(k) or 0.0 for r in later) for k in PER_STEP}
    emit(
        {
            "figure": "e2e_gpu_median",
            "shape": shape,
            **setup,
            "steps": len(later),
            **medians,
            "mismatch_max": max(r["gen/logprob_mismatch"] for r in steps),
            "lora_rank": args.lora or None,
            **getattr(args, "device_memory", {}),
            **(scale_figures(args.paths[shape], medians, args) if scale else {}),
            **args.ceilings,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shapes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(QWEN25_SHAPES)
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=None)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument(
        "--real-vocab", action="store_true", help="real Qwen2.5 shapes, vocabulary 151,936"
    )
    parser.add_argument(
        "--mean-length", type=float, default=None, help="spread response lengths (real vocab)"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (CPU dry runs)")
    parser.add_argument("--trl", action="store_true", help="side by side with TRL")
    parser.add_argument("--trl-micro-batch", type=int, default=8)
    parser.add_argument(
        "--trl-python", default=sys.executable, help="the Python that has TRL (default: this)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: every weight)")
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="more tandem overrides, e.g. policy.share_prompts=false for an A/B",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    root = Path(tempfile.gettempdir()) / "tandem-e2e"
    args.paths = {shape: model_dir(shape, args, root, cuda) for shape in args.shapes}
    args.ceilings = {k: round(v, 2) for k, v in measure_ceilings().items()} if cuda else {}
    if cuda:
        torch.cuda.empty_cache()
    for shape, path in args.paths.items():
        if args.trl:
            side_by_side(shape, path, args, root)
        else:
            emit_breakdown(shape, run_tandem(path, args, root / "runs"), args)


def model_dir(shape: str, args: argparse.Namespace, root: Path, cuda: bool) -> Path:
    """The random model of ``shape`` (written once per setting under ``root``)."""
    device = "cuda" if cuda else "cpu"
    if args.real_vocab:
        name = real_shape_dir(shape, args.mean_length, args.layers)
        return write_real_shape(root / name, shape, args.mean_length, args.layers, device=device)
    if shape not in QWEN25_SHAPES:
        raise SystemExit(
            f"--shapes {shape} needs --real-vocab (the embedded vocabulary has 0.5b, 1.5b)"
        )
    return write_random_qwen2(root / f"qwen2-{shape}", QWEN25_SHAPES[shape], device=device)


if __name__ == "__main__":
    from tandem.interrupts import signals_as_interrupts

    # SIGTERM (real_scale.py's stop at a part's limit) unwinds the run as Ctrl-C does: its
    # workers and Ray are shut down on the way out
    with signals_as_interrupts("bench/e2e_gpu.py"):
        main()
