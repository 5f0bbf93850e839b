"""One decode step's sampling over a real vocabulary: the HF generator's ``sample_tokens``
(inverse CDF over blocks of rows, bf16 logits in, per-row seeded) beside the textbook way
(the batch's logits to fp32, softmax, ``torch.multinomial``, log-softmax for the logprob),
the parts of the plain draw alone (the per-row uniforms, the fp32 softmax, the cumulative sum
over the whole vocabulary), and a candidate that scans chunks instead of the vocabulary
(``chunked_cdf``: the chunks' sums, their cumulative sum, then one chunk's; its tokens against
``sample_tokens``' as ``same_tokens``). One JSON line per way: median seconds of a step over
``--repeats``.

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
from tandem.generation.hf_generator import sample_keys, sample_tokens, uniform_draws


def textbook(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    full = logits.float()
    token = torch.multinomial(torch.softmax(full, dim=-1), 1)[:, 0]
    return token, torch.log_softmax(full, dim=-1).gather(-1, token[:, None])[:, 0]


def chunked_cdf(
    logits: torch.Tensor, uniform: torch.Tensor, chunk: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling at ``uniform`` without a cumulative sum over the vocabulary: the
    chunk holding the target from the chunks' sums, then the token within that chunk."""
    rows, vocab = logits.shape
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    parts = torch.nn.functional.pad(probs, (0, -vocab % chunk)).view(rows, -1, chunk)
    chunk_cdf = parts.sum(-1).cumsum(-1)
    target = uniform[:, None] * chunk_cdf[:, -1:]
    index = torch.searchsorted(chunk_cdf, target, right=True).clamp_(max=chunk_cdf.shape[1] - 1)
    before = chunk_cdf.gather(-1, (index - 1).clamp(min=0)) * (index > 0)
    inner = parts.gather(1, index[:, :, None].expand(-1, -1, chunk))[:, 0].cumsum(-1) + before
    offset = torch.searchsorted(inner, target, right=True).clamp_(max=chunk - 1)
    token = (index * chunk + offset)[:, 0].clamp_(max=vocab - 1)
    picked = probs.gather(-1, token[:, None])[:, 0]
    return token, picked.clamp_(min=torch.finfo(torch.float32).tiny).log_()


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
    uniform = uniform_draws(keys, 3)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ways = {
        "sample_tokens": lambda: sample_tokens(logits, keys, 3, params),
        "fp32_multinomial": lambda: textbook(logits),
        "part_uniform_draws": lambda: uniform_draws(keys, 3),
        "part_softmax_fp32": lambda: torch.softmax(logits, dim=-1, dtype=torch.float32),
        "part_cumsum": lambda: probs.cumsum(-1),
        "chunked_cdf": lambda: chunked_cdf(logits, uniform),
    }
    reference = sample_tokens(logits, keys, 3, params)[0]
    same = float((chunked_cdf(logits, uniform)[0] == reference).float().mean())
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
                **({"same_tokens": same} if name == "chunked_cdf" else {}),
            }
        )


if __name__ == "__main__":
    main()
