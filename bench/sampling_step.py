"""One decode step's sampling over a real vocabulary: the HF generator's ``sample_tokens``
(inverse CDF over blocks of rows, bf16 logits in, per-row seeded) beside the textbook way
(the batch's logits to fp32, softmax, ``torch.multinomial``, log-softmax for the logprob).
One JSON line per way: median seconds of a step over ``--repeats``.

    PYTHONPATH=src:bench python bench/sampling_step.py [--rows 256] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from ceilings import emit

from tandem.generation import hf_generator
from tandem.generation.base import SamplingParams
from tandem.generation.hf_generator import sample_keys, sample_tokens


def textbook(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    full = logits.float()
    token = torch.multinomial(torch.softmax(full, dim=-1), 1)[:, 0]
    return token, torch.log_softmax(full, dim=-1).gather(-1, token[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block", type=int, default=None, help="hf_generator.SAMPLE_BLOCK")
    args = parser.parse_args()
    if args.block:
        hf_generator.SAMPLE_BLOCK = args.block
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(args.rows, args.vocab, device=device).bfloat16()
    keys = sample_keys(list(range(args.rows)), device)
    params = SamplingParams(temperature=1.0)
    ways = {
        "sample_tokens": lambda: sample_tokens(logits, keys, 3, params),
        "fp32_multinomial": lambda: textbook(logits),
    }
    for name, step in ways.items():
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        emit(
            {
                "figure": "sampling_step_s",
                "way": name,
                "rows": args.rows,
                "block": hf_generator.SAMPLE_BLOCK,
                "vocab": args.vocab,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "median_s": round(statistics.median(times[1:]), 5),
            }
        )


if __name__ == "__main__":
    main()
