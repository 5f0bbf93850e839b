"""The HF generator on the GPU beside ``transformers.generate`` on the same batch.

A random Qwen2 of the 0.5B shape (bf16) with the embedded tokenizer generates 32 prompts x 8
samples of up to 128 tokens: tandem's decode with CUDA graphs, without them (static cache,
eager) and with the dynamic cache, and ``model.generate`` (sampling, its own dynamic cache),
alternating, ``--rounds`` times each. One JSON line per path: the median seconds, the tokens
per second, and the ratio to ``generate``.

    PYTHONPATH=src:bench python bench/hf_generate_gpu.py [--shape 0.5b] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ceilings import emit

from tandem.assets import write_random_qwen2
from tandem.assets.real_shapes import QWEN25_SHAPES
from tandem.generation import SamplingParams
from tandem.generation.hf_generator import HfGenerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="0.5b", choices=QWEN25_SHAPES)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = Path(tempfile.gettempdir()) / f"hfgen-qwen2-{args.shape}"
    write_random_qwen2(path, QWEN25_SHAPES[args.shape], device="cuda")
    generator = HfGenerator(path, device="cuda:0", dtype="bfloat16")
    texts = [f"{a}+{b}=" for a, b in zip(range(11, 99, 3), range(7, 95, 3), strict=False)]
    prompts = [generator.tokenizer.encode(t) for t in texts][: args.prompts]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.generations)
    model, pad = generator.model, generator.pad_token_id

    def ours(graphs: bool, static: bool) -> int:
        generator.cuda_graphs, generator.static_cache = graphs, static
        return sum(len(r.response_token_ids) for r in generator.generate(prompts, params))

    def transformers_generate() -> int:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda:0")
        mask = (
            torch.arange(width, device="cuda:0")[None]
            >= width - torch.tensor([len(p) for p in prompts], device="cuda:0")[:, None]
        ).long()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.repeat_interleave(args.generations, 0),
                attention_mask=mask.repeat_interleave(args.generations, 0),
                do_sample=True,
                max_new_tokens=args.max_tokens,
                pad_token_id=pad,
                top_k=0,
            )
        return int((out[:, width:] != pad).sum())

    paths = {
        "tandem_cuda_graphs": lambda: ours(True, True),
        "tandem_static_eager": lambda: ours(False, True),
        "tandem_dynamic": lambda: ours(False, False),
        "transformers_generate": transformers_generate,
    }
    for run in paths.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, run in paths.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens[name] = run()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    reference = statistics.median(times["transformers_generate"])
    for name, values in times.items():
        median = statistics.median(values)
        emit(
            {
                "figure": "hf_generate_s",
                "path": name,
                "shape": args.shape,
                "value": round(median, 3),
                "runs": [round(v, 3) for v in values],
                "tokens": tokens[name],
                "tokens_per_s": round(tokens[name] / median),
                "ratio_to_generate": round(median / reference, 3),
                "work": f"{args.prompts}x{args.generations}x<={args.max_tokens}",
            }
        )


if __name__ == "__main__":
    main()
