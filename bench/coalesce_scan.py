"""CPU cost of ``coalesce``: the scan ``copy_tensors`` makes of every pair before it copies.

A model's tensors (names and shapes of a Qwen2 config) laid out twice as ``HfGenerator`` and
``onload()`` lay parameters out (``device_copies``), then ``coalesce(dsts, srcs)`` timed alone:
best of ``--repeats``, in µs per pair. Shapes are as in the model on CUDA; on the CPU the rows
of every matrix are divided by ``--shrink`` (the scan's cost does not depend on sizes, and a
row stays a multiple of the 256-byte alignment, so the runs are the model's).

    PYTHONPATH=src:bench python bench/coalesce_scan.py [--model 1.5b] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch
from ceilings import emit
from refit_gpu import SHAPES, metadata

from tandem.tensors.copies import coalesce, device_copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shrink", type=int, default=64, help="CPU only: divide rows by this")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    shrink = 1 if device.type == "cuda" else args.shrink
    shapes = [
        (m.shape[0] // shrink, *m.shape[1:]) if len(m.shape) == 2 else m.shape
        for m in metadata(SHAPES[args.model])
    ]
    srcs, dsts = (
        device_copies([torch.zeros(s, dtype=torch.bfloat16) for s in shapes], device)
        for _ in range(2)
    )
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        runs = coalesce(dsts, srcs)
        best = min(best, time.perf_counter() - start)
    emit(
        {
            "figure": "coalesce_scan_us_per_pair",
            "model": args.model,
            "device": device.type,
            "pairs": len(shapes),
            "runs": len(runs),
            "value": round(best / len(shapes) * 1e6, 2),
        }
    )


if __name__ == "__main__":
    main()
