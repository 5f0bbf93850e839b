"""What image prompts cost beyond their tokens on a CPU, in CPU seconds: the embedded
vision-language model's trainer forward and backward of one micro-batch, and its transformers
generator's rollouts, on image prompts and on text prompts of as many tokens, interleaved.

``bench/vlm_gpu.py --shape tiny`` times whole GRPO steps by the wall clock, one run after the
other, which the load of a shared machine scatters; this takes each phase's process CPU time
(one thread) and alternates images and text, so both see the same machine. One JSON line per
phase: the median seconds of each kind (the first ``--warmup`` rounds left out) and the ratio
images / text; then the two phases together per generated token (a GRPO step's generation and
training), images / text (the goal: at most 1.3).

    ./run.sh python bench/vlm_cpu_cost.py [--prompts 16] [--generations 8] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable


def prompts(count: int) -> tuple[list, list[list[int]]]:
    """``count`` image prompts of the visual task and text prompts of as many tokens (filler
    words before the same question, as ``bench/vlm_gpu.py`` pads them), each text prompt
    starting with its own number: distinct prompts, as the images make theirs (the generator
    prefills rows of equal tokens once, and a text prompt's ``n`` samples share its prefill
    while an image prompt's do not). The embedded tokenizer takes a byte a token."""
    from transformers import AutoTokenizer

    from tandem.assets import VISUAL_MODEL_DIR
    from tandem.data.images import VisionProcessor
    from tandem.data.visual import QUESTION, scenes

    tokenizer = AutoTokenizer.from_pretrained(str(VISUAL_MODEL_DIR))
    processor = VisionProcessor(VISUAL_MODEL_DIR, tokenizer)
    images = [processor(QUESTION, [scene.draw()]) for scene in scenes(count, 0, held_out=False)]
    length = len(images[0])
    words = 1
    while len(tokenizer.encode(" x" * words + " " + QUESTION)) < length:
        words += 1
    text = tokenizer.encode(" x" * words + " " + QUESTION, add_special_tokens=False)
    numbered = [list(f"{index:03d}".encode()) for index in range(count)]
    return images, [number + text[len(number) :] for number in numbered]


def train_pass(model: object, rows: list[list[int]], response: list[int]) -> Callable[[], int]:
    """One micro-batch of ``rows`` (each a prompt and ``response``): the trainer's chunked
    logprobs forward (vision tower and multimodal positions for image rows) and backward."""
    import torch

    from tandem.data.images import RowImages
    from tandem.trainer.logprobs import LogprobModel

    logprob_model = LogprobModel(model, chunk_size=1024)  # type: ignore[arg-type]
    input_ids = torch.tensor([list(row) + response for row in rows])
    images = RowImages.of(rows)

    def run() -> int:
        logprobs, _ = logprob_model(input_ids, None, images=images)
        logprobs.sum().backward()
        logprob_model.zero_grad(set_to_none=True)
        return len(rows) * len(response)

    return run


def generate_pass(generator: object, rows: list[list[int]], params: object) -> Callable[[], int]:
    """The generator's rollouts of ``rows``; returns the tokens it generated."""

    def run() -> int:
        rollouts = generator.generate(rows, params)  # type: ignore[attr-defined]
        return sum(len(r.response_token_ids) for r in rollouts)

    return run


def cpu_seconds(run: Callable[[], int]) -> tuple[float, int]:
    """``run``'s process CPU seconds and the tokens it returned."""
    start = time.process_time()
    tokens = run()
    return time.process_time() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText

    from tandem.assets import VISUAL_MODEL_DIR
    from tandem.generation import SamplingParams
    from tandem.generation.hf_generator import HfGenerator

    torch.set_num_threads(1)
    images, text = prompts(args.prompts)
    model = AutoModelForImageTextToText.from_pretrained(str(VISUAL_MODEL_DIR), dtype=torch.float32)
    generator = HfGenerator(VISUAL_MODEL_DIR)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.generations)
    response = [ord("2"), generator.tokenizer.eos_token_id]
    phases: dict[str, dict[str, Callable[[], int]]] = {
        "train_micro_batch": {
            kind: train_pass(model, [p for p in rows for _ in range(args.generations)], response)
            for kind, rows in (("images", images), ("text", text))
        },
        "generate": {
            kind: generate_pass(generator, rows, params)
            for kind, rows in (("images", images), ("text", text))
        },
    }
    medians: dict[str, dict[str, tuple[float, float]]] = {}
    for phase, runs in phases.items():
        medians[phase] = measure(runs, args.rounds, args.warmup)
        line = {
            "phase": phase,
            "rows": args.prompts * args.generations,
            "prompt_tokens": len(text[0]),
            **{f"median_cpu_s/{k}": cpu for k, (cpu, _) in medians[phase].items()},
            **{f"median_tokens/{k}": count for k, (_, count) in medians[phase].items()},
            "images_over_text": medians[phase]["images"][0] / medians[phase]["text"][0],
        }
        print(json.dumps(line), flush=True)
    per_token = {
        kind: sum(medians[phase][kind][0] for phase in phases) / medians["generate"][kind][1]
        for kind in ("images", "text")
    }
    step = {f"cpu_s_per_generated_token/{k}": v for k, v in per_token.items()}
    ratio = per_token["images"] / per_token["text"]
    print(json.dumps({"phase": "step", **step, "images_over_text": ratio, "goal": 1.3}))


def measure(
    runs: dict[str, Callable[[], int]], rounds: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Each kind's median CPU seconds and tokens over ``rounds`` alternating rounds, the first
    ``warmup`` left out."""
    seconds: dict[str, list[float]] = {kind: [] for kind in runs}
    tokens: dict[str, list[int]] = {kind: [] for kind in runs}
    for _ in range(rounds):
        for kind, run in runs.items():
            cpu, count = cpu_seconds(run)
            seconds[kind].append(cpu)
            tokens[kind].append(count)
    return {
        kind: (statistics.median(seconds[kind][warmup:]), statistics.median(tokens[kind][warmup:]))
        for kind in runs
    }


if __name__ == "__main__":
    main()
