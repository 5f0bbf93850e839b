"""How many of a model's weights AdamW changes when the weights are kept in bfloat16
(``policy.dtype=bfloat16`` training every weight): a random Qwen2.5-shape model (vocabulary
151,936) in bf16, ``--steps`` AdamW steps of a next-token loss on random tokens at each ``--lrs``;
one JSON line per learning rate with the share of weights that changed (an update below about
1/256 of its weight rounds away). The figure behind ``preflight.warn_bf16_weights``.

    PYTHONPATH=src python bench/bf16_updates.py [--shape 0.5b] [--layers 2] [--lrs 1e-6 1e-5 1e-4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers

from tandem.assets.real_shapes import real_shape_dir, write_real_shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "tandem-e2e"
    path = write_real_shape(
        root / real_shape_dir(args.shape, layers=args.layers), args.shape, num_layers=args.layers
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 151_000, (2, 64))
    for lr in args.lrs:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for _ in range(args.steps):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        pairs = zip(model.parameters(), before, strict=True)
        changed = sum(int((p.detach() != b).sum()) for p, b in pairs)
        total = sum(b.numel() for b in before)
        line = {"figure": "bf16_updates", "shape": args.shape, "layers": args.layers, "lr": lr}
        print(json.dumps({**line, "steps": args.steps, "changed": round(changed / total, 4)}))


if __name__ == "__main__":
    main()
