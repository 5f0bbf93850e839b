"""What a new shape costs each attention kernel of ``scaled_dot_product_attention``: causal
forward + backward in bf16 at the 1.5B shape's heads (12 x 128), for ``--shapes`` micro-batch
shapes never seen before (rows and length drawn as the loop's length-sorted micro-batches take
them), the first call of each shape against the same call again. cuDNN's kernel builds a graph
per shape; the loop's micro-batches take new shapes every step. One JSON line per kernel.

    python bench/sdpa_shapes.py [--shapes 12] [--tokens 65536]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

KERNELS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def call(rows: int, length: int, heads: int, dim: int) -> float:
    """Seconds of one forward + backward on fresh inputs of that shape."""
    q, k, v = (
        torch.randn(rows, heads, length, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=65536, help="a micro-batch's token budget")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    for name, kernel in KERNELS.items():
        rng = random.Random(name)  # each kernel its own shapes: none warmed by another
        shapes = []
        for _ in range(args.shapes):
            length = rng.randrange(200, 2100)
            shapes.append((max(1, min(64, args.tokens // length)), length))
        first, again = [], []
        try:
            with sdpa_kernel([kernel]):
                call(2, 128, args.heads, args.dim)  # the kernel's own start, outside the figures
                for rows, length in shapes:
                    first.append(call(rows, length, args.heads, args.dim))
                    again.append(call(rows, length, args.heads, args.dim))
        except RuntimeError as error:  # a kernel this GPU or build lacks
            print(json.dumps({"figure": "sdpa_shapes", "kernel": name, "error": str(error)[:200]}))
            continue
        print(
            json.dumps(
                {
                    "figure": "sdpa_shapes",
                    "kernel": name,
                    "device": torch.cuda.get_device_name(),
                    "shapes": len(shapes),
                    "first_call_ms": round(statistics.median(first) * 1e3, 2),
                    "again_ms": round(statistics.median(again) * 1e3, 2),
                    "new_shapes_total_ms": round(sum(first) * 1e3, 1),
                    "same_shapes_total_ms": round(sum(again) * 1e3, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
