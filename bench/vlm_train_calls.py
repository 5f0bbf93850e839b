"""What image rows add to a train step in calls, not arithmetic: a Qwen2.5-VL with the 3B
shape's depths and windows (36 decoder layers; a 32-block vision tower attending in 112-pixel
windows, 4 blocks over whole images) but narrow widths, so that the host's work per call is
what the seconds measure; the trainer (``PolicyTrainer.train``, activation checkpointing) on
rows with 448-pixel images and on text rows of as many tokens, and again with the tower's
attention one call per window (transformers' own, without flash attention) instead of one per
window length (``tandem.vision_attention``).

On a GPU each aten call that reads or writes data is at least one kernel launch; a step that
makes many more of them than its arithmetic needs is launch-bound there. One JSON line per
case: aten data calls and seconds of one train step, per micro-batch.

    PYTHONPATH=src:bench python bench/vlm_train_calls.py [--prompts 4] [--generations 4]
        [--micro-batch-size 8] [--image-size 448] [--response 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from aten_calls import AtenCalls

NARROW = Path(tempfile.gettempdir()) / "tandem-bench" / "qwen2.5-vl-3b-depths-narrow"
"""Where ``narrow_vl`` writes its model by default."""


def narrow_vl(path: Path = NARROW) -> Path:
    """The 3B shape's depths and windows at narrow widths, with the embedded byte tokenizer
    and its vision tokens (the real vocabulary's head would be the arithmetic here)."""
    from tandem.assets.vision import (
        QWEN25_VL_VISION,
        VISION_TOKENS,
        _vl_config,
        _write,
        image_processor,
        tiny_tokenizer,
    )

    if (path / "config.json").exists():
        return path
    tokenizer = tiny_tokenizer()
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ids = {
        name: tokenizer.convert_tokens_to_ids(t)
        for name, t in zip(names, VISION_TOKENS[:4], strict=True)
    }
    eos = tokenizer.eos_token_id
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=256,  # two heads of 128: the multimodal rotary sections need 128
        intermediate_size=512,
        num_hidden_layers=36,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    vision = QWEN25_VL_VISION | {"hidden_size": 128, "intermediate_size": 256, "num_heads": 2}
    config = _vl_config(text, vision, ids)
    processor = image_processor(14, 2, (56 * 56, 28 * 28 * 1280))
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write(path, config, tokenizer, processor, "float32")


def batch(model: Path, args: argparse.Namespace, images: bool) -> Any:
    """``prompts`` x ``generations`` rows (a prompt's samples share its image), responses of
    ``response`` random tokens; text rows padded to the image rows' prompt length."""
    from PIL import Image
    from transformers import AutoTokenizer

    from tandem.data.batch import right_padded
    from tandem.data.images import VisionProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    processor = VisionProcessor(model, tokenizer)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for p in range(args.prompts):
        pixels = (torch.rand(args.image_size, args.image_size, 3, generator=gen) * 255).byte()
        prompt = processor(f"How many shapes? {p}", [Image.fromarray(pixels.numpy(), "RGB")])
        if not images:  # as many tokens, no image
            prompt = list(torch.randint(0, 250, (len(prompt),), generator=gen).tolist())
        for _ in range(args.generations):
            response = torch.randint(0, 250, (args.response,), generator=gen).tolist()
            rows.append((prompt, response))
    return right_padded(rows, pad_token_id=tokenizer.pad_token_id or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--response", type=int, default=32)
    args = parser.parse_args()
    from tandem.algorithms.losses import nll_loss
    from tandem.config.models import OptimizerConfig, PolicyConfig
    from tandem.trainer import PolicyTrainer

    model = narrow_vl()
    config = PolicyConfig(
        model_path=model,
        micro_batch_size=args.micro_batch_size,
        activation_checkpointing=True,
        optimizer=OptimizerConfig(lr=1e-6),
    )
    trainer = PolicyTrainer(config)
    attention = [block.attn for block in trainer.lm.model.visual.blocks]
    attention = [getattr(a, "_checkpoint_wrapped_module", a) for a in attention]
    batched_class = type(attention[0])
    plain_class = batched_class.__mro__[1]
    micro_batches = -(-args.prompts * args.generations // args.micro_batch_size)
    for name, images, windows in (
        ("text", False, "batched"),
        ("images", True, "batched"),
        ("images", True, "per_window"),
    ):
        for module in attention:
            module.__class__ = batched_class if windows == "batched" else plain_class
        data = batch(model, args, images)
        trainer.train(data, nll_loss)  # warm-up
        with AtenCalls() as calls:
            trainer.train(data, nll_loss)
        start = time.perf_counter()
        trainer.train(data, nll_loss)
        seconds = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "figure": "vlm_train_calls",
                    "rows": name,
                    "tower_attention": windows,
                    "tokens_per_row": int(data.input_ids.shape[1]),
                    "micro_batches": micro_batches,
                    "aten_data_calls_per_micro_batch": calls.count // micro_batches,
                    "seconds_per_micro_batch": round(seconds / micro_batches, 3),
                    "threads": torch.get_num_threads(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
