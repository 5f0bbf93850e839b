"""The vision tower's windowed attention: one SDPA call per window (transformers without flash
attention) against one call per window length (``tandem.vision_attention``), forward and
backward of a random Qwen2.5-VL tower on random images, alternating, on this machine's device.

A 448x448 image is 1024 patches, 16 windows of 64; 16 images (a micro-batch of two prompts'
samples holds two, a micro-batch of 16 prompts sixteen) make 256 windows a block. One JSON line:
the medians of both, their ratio, the attention calls a forward makes each way.

    PYTHONPATH=src python bench/vision_windows.py [--depth 32] [--images 16] [--size 448]
        [--rounds 5] [--tiny]

``--tiny``: the embedded tiny model's tower (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(
    tiny: bool, depth: int | None, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from tandem.assets.vision import QWEN25_VL_VISION, TINY_VISION

    settings = dict(TINY_VISION if tiny else QWEN25_VL_VISION)
    if depth is not None:
        settings["depth"] = depth
        settings["fullatt_block_indexes"] = [
            i for i in settings["fullatt_block_indexes"] if i < depth
        ]
    config = Qwen2_5_VLVisionConfig(**settings)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        tower = Qwen2_5_VisionTransformerPretrainedModel(config)
    return tower.to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from tandem import vision_attention

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tower = build(args.tiny, args.depth, device, dtype)
    config = tower.config
    side = args.size // config.patch_size
    grid = torch.tensor([[1, side, side]] * args.images, device=device)
    width = 3 * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(args.images * side * side, width, device=device, dtype=dtype)
    modules = [block.attn for block in tower.blocks]
    plain = type(modules[0])
    vision_attention.batch_vision_windows(tower)
    batched = type(modules[0])
    calls = {"per_window": 0, "batched": 0}

    def step(kind: str) -> float:
        for module in modules:
            module.__class__ = plain if kind == "per_window" else batched
        tower.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = tower(pixels, grid_thw=grid)
        hidden = getattr(out, "pooler_output", None)
        hidden = out if hidden is None else hidden
        hidden = torch.cat(list(hidden)) if isinstance(hidden, (list, tuple)) else hidden
        hidden.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    count = {"n": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        count["n"] += 1
        return sdpa(*a, **k)

    for kind in calls:  # warm-up, and the calls of a forward and backward each way
        torch.nn.functional.scaled_dot_product_attention = counting
        count["n"] = 0
        step(kind)
        calls[kind] = count["n"]
        torch.nn.functional.scaled_dot_product_attention = sdpa
    seconds: dict[str, list[float]] = {kind: [] for kind in calls}
    for _ in range(args.rounds):
        for kind in calls:
            seconds[kind].append(step(kind))
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    print(
        json.dumps(
            {
                "figure": "vision_window_attention",
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "depth": len(modules),
                "images": args.images,
                "size": args.size,
                "patches": int(pixels.shape[0]),
                "per_window_s": round(median["per_window"], 4),
                "batched_s": round(median["batched"], 4),
                "per_window_over_batched": round(median["per_window"] / median["batched"], 2),
                "sdpa_calls": calls,
                "rounds": {k: [round(x, 4) for x in v] for k, v in seconds.items()},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
