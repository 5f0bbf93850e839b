"""How many of a model's weights AdamW changes when the weights are kept in bfloat16
(``policy.dtype=bfloat16`` training every weight): a random Qwen2.5-shape model (vocabulary
151,936) in bf16, ``--steps`` AdamW steps of a next-token loss on random tokens at each ``--lrs``;
one JSON line per learning rate and optimizer with the share of weights that changed (an update
below about 1/256 of its weight rounds away) and ``kept``: the change projected on that of fp32
weights from the same start (1: the fp32 update, 0: none of it). The figure behind
``preflight.warn_bf16_weights``. Optimizers: torch's AdamW rounding to nearest, and, where
torchao imports (the lowbit extra), the one of ``policy.optimizer.bf16_stochastic_round``.

    PYTHONPATH=src python bench/bf16_updates.py [--shape 0.5b] [--layers 2] [--lrs 1e-6 1e-5 1e-4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

import torch
import transformers

from tandem.assets.real_shapes import real_shape_dir, write_real_shape
from tandem.config.models import OptimizerConfig
from tandem.trainer.schedule import build_optimizer


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
    rounding = ["nearest"] + (["stochastic"] if importlib.util.find_spec("torchao") else [])

    def change(lr: float, dtype: torch.dtype, stochastic: bool) -> list[torch.Tensor]:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        model.to(dtype)  # fp32: the same bf16 start, upcast
        before = [p.detach().float().clone() for p in model.parameters()]
        config = OptimizerConfig(lr=lr, bf16_stochastic_round=stochastic)
        optimizer, _ = build_optimizer(list(model.parameters()), config, None)
        torch.manual_seed(1)
        for _ in range(args.steps):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().float() - b for p, b in zip(model.parameters(), before, strict=True)]

    for lr in args.lrs:
        reference = change(lr, torch.float32, False)
        norm = sum(float((r * r).sum()) for r in reference)
        for how in rounding:
            delta = change(lr, torch.bfloat16, how == "stochastic")
            changed = sum(int((d != 0).sum()) for d in delta) / sum(d.numel() for d in delta)
            kept = sum(float((d * r).sum()) for d, r in zip(delta, reference, strict=True)) / norm
            line = {"figure": "bf16_updates", "shape": args.shape, "layers": args.layers, "lr": lr}
            line |= {"rounding": how, "steps": args.steps, "changed": round(changed, 4)}
            print(json.dumps({**line, "kept": round(kept, 3)}), flush=True)


if __name__ == "__main__":
    main()
