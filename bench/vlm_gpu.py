"""GRPO on image prompts through the real runtime, against text prompts of the same length on
the same model: what images cost beyond their tokens.

A random Qwen2.5-VL of the 3B shape (``tandem.assets.vision.write_real_shape_vl``: the
Qwen2.5-3B language model, Qwen2.5-VL's 32-block vision tower, the 151,936-token vocabulary)
runs ``--steps`` GRPO steps twice through ``tandem grpo`` (``run_grpo``; Ray actors,
colocated, the memory phases, the refit): once on the visual task's images (count the shapes,
drawn at ``--image-size`` pixels: 448 px are 1024 patches, 256 image tokens), once on text
prompts padded to the same number of tokens. One JSON line per step (phases' seconds, the
trainer's memory after offload / at rest / at its refit peak, the generator/trainer logprob
mismatch, generated tokens), one per run (medians of the steps after the first; seconds per
generated token; the device's memory in use, sampled every 20 ms, at its peak and least), and
the ratio images / text of the seconds per generated token (goal: at most 1.3).

    PYTHONPATH=.gpu/site:src:bench python bench/vlm_gpu.py [--steps 4] [--prompts 16]
        [--generations 8] [--max-tokens 128] [cluster.env_mode=shared generation.backend=hf ...]

Trailing ``key=value`` arguments are config overrides for both runs (the GPU machine:
``cluster.env_mode=shared generation.backend=hf``). ``--shape tiny`` runs the embedded tiny
vision-language model (fp32, 48 px images) on a CPU machine in a few minutes, to check the
script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = str(Path(__file__).resolve().parent)
sys.path.insert(0, BENCH)  # e2e_gpu, and e2e_rewards for the dense reward
# the reward's workers and the actors import e2e_rewards too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [BENCH, os.environ.get("PYTHONPATH")]))

from e2e_gpu import PER_STEP, DeviceMemory  # noqa: E402


def model_folder(shape: str) -> Path:
    """The model of ``shape``: the embedded tiny VL model, or a cached random Qwen2.5-VL."""
    from tandem.assets import VISUAL_MODEL_DIR
    from tandem.assets.vision import write_real_shape_vl

    if shape == "tiny":
        return VISUAL_MODEL_DIR
    import torch

    base = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    path = base / "models" / f"qwen2.5-vl-{shape}-random"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return write_real_shape_vl(path, shape, device=device)


def write_data(model: Path, root: Path, count: int, image_size: int) -> tuple[Path, Path, int]:
    """Image rows and text rows of as many prompt tokens (filler words before the question);
    returns both files and that length."""
    from transformers import AutoTokenizer

    from tandem.data.images import VisionProcessor
    from tandem.data.visual import QUESTION, scenes

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for index, scene in enumerate(scenes(count, 0, held_out=False)):
        path = root / "images" / f"{index:05d}.png"
        scene.draw().resize((image_size, image_size)).save(path)
        rows.append({"question": QUESTION, "answer": scene.answer, "image": str(path)})
    images = root / "images.jsonl"
    images.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = rows[0]
    from PIL import Image

    length = len(VisionProcessor(model, tokenizer)(QUESTION, [Image.open(first["image"])]))
    words = 1
    while len(tokenizer.encode(" x" * words + " " + QUESTION)) < length:
        words += 1
    padded = " x" * words + " " + QUESTION
    text = root / "text.jsonl"
    text.write_text("".join(json.dumps({**r, "question": padded}) + "\n" for r in rows))
    return images, text, length


def run(kind: str, data: Path, model: Path, args: argparse.Namespace, root: Path) -> list[dict]:
    from tandem.config import GrpoConfig, load_config
    from tandem.driver import run_grpo

    shutil.rmtree(root / "runs" / kind, ignore_errors=True)
    overrides = [
        f"policy.model_path={model}",
        f"policy.micro_batch_size={args.micro_batch_size}",
        "policy.optimizer.lr=1e-5",
        f"policy.mixed_precision={str(args.shape != 'tiny').lower()}",
        # fp32 masters and Adam state of 3.75B parameters take 60 GB: the activations of
        # 16 rows (each with an image of 1024 patches) are recomputed to fit beside them
        f"policy.activation_checkpointing={str(args.shape != 'tiny').lower()}",
        f"algorithm.num_steps={args.steps}",
        f"algorithm.prompts_per_step={args.prompts}",
        f"algorithm.num_generations={args.generations}",
        "algorithm.eval_every=0",
        f"generation.sampling.max_tokens={args.max_tokens}",
        "data.task=jsonl",
        f"data.train_path={data}",
        *(["data.image_key=image"] if kind == "images" else []),
        "data.reward=e2e_rewards:digit_fraction",
        "checkpoint.enabled=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={root / 'runs'}",
        f"logging.name={kind}",
        *args.overrides,
    ]
    with DeviceMemory() as memory:
        records = run_grpo(load_config(GrpoConfig, "grpo_visual", overrides))
    args.device_memory = memory.figures()
    return [r for r in records if "timing/step_s" in r]


def summarise(kind: str, steps: list[dict], args: argparse.Namespace, length: int) -> dict:
    per_token = []
    for record in steps:
        generated = record["train/response_len_mean"] * args.prompts * args.generations
        record["generated_tokens"] = generated
        record["step_s_per_generated_token"] = record["timing/step_s"] / generated
        per_token.append(record["step_s_per_generated_token"])
        line = {k: record.get(k) for k in ("step", *PER_STEP, "generated_tokens")}
        print(json.dumps({"run": kind, **line}), flush=True)
    later = steps[1:] or steps

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in later)

    summary = {
        "run": kind,
        "summary": True,
        "shape": args.shape,
        "prompt_tokens": length,
        "steps": len(steps),
        **{f"median/{k}": median(k) for k in PER_STEP},
        "median/step_s_per_generated_token": statistics.median(per_token[1:] or per_token),
        "max/gen_logprob_mismatch": max(r["gen/logprob_mismatch"] for r in steps),
        **args.device_memory,
    }
    print(json.dumps(summary), flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["3b", "7b", "tiny"], default="3b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides key=value (both runs)")
    args = parser.parse_args()
    size = args.image_size or (48 if args.shape == "tiny" else 448)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        model = model_folder(args.shape)
        images, text, length = write_data(model, root, args.prompts * args.steps, size)
        results = {}
        for kind, data in (("images", images), ("text", text)):
            results[kind] = summarise(kind, run(kind, data, model, args, root), args, length)
    key = "median/step_s_per_generated_token"
    ratio = results["images"][key] / results["text"][key]
    print(json.dumps({"images_over_text_step_s_per_generated_token": ratio, "goal": 1.3}))


if __name__ == "__main__":
    main()
