"""What image prompts cost beyond their tokens on a CPU: the embedded vision-language model's
trainer forward and backward of one micro-batch, and its transformers generator's rollouts, on
image prompts and on text prompts of as many tokens, interleaved.

``bench/vlm_gpu.py --shape tiny`` times whole GRPO steps by the wall clock, one run after the
other, which the load of a shared machine scatters; this alternates images and text phase by
phase, so both see the same machine, and takes each phase's process CPU time beside its wall
time (``--threads``: torch's intra-op threads; one thread's CPU time is the steadiest
figure, the wall time with the machine's threads the one a run sees). One JSON line per
phase: the median seconds of each kind (the first ``--warmup`` rounds left out) and the ratios
images / text; then the two phases together per generated token (a GRPO step's generation and
training), images / text (the goal: at most 1.3).

    ./run.sh python bench/vlm_cpu_cost.py [--threads 1] [--prompts 16] [--generations 8]
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


def timed(run: Callable[[], int]) -> tuple[float, float, int]:
    """``run``'s process CPU seconds, wall seconds and the tokens it returned."""
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = run()
    return time.process_time() - cpu, time.perf_counter() - wall, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText

    from tandem.assets import VISUAL_MODEL_DIR
    from tandem.generation import SamplingParams
    from tandem.generation.hf_generator import HfGenerator

    torch.set_num_threads(args.threads)
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
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for phase, runs in phases.items():
        medians[phase] = measure(runs, args.rounds, args.warmup)
        line: dict[str, object] = {"phase": phase, "threads": args.threads}
        line |= {"rows": args.prompts * args.generations, "prompt_tokens": len(text[0])}
        for key in ("cpu_s", "wall_s", "tokens"):
            line |= {f"median_{key}/{kind}": m[key] for kind, m in medians[phase].items()}
        for key in ("cpu_s", "wall_s"):
            line[f"{key}/images_over_text"] = ratio(medians[phase], key)
        print(json.dumps(line), flush=True)
    step: dict[str, object] = {"phase": "step", "threads": args.threads}
    for key in ("cpu_s", "wall_s"):
        per_token = {
            kind: {
                key: sum(medians[p][kind][key] for p in phases)
                / medians["generate"][kind]["tokens"]
            }
            for kind in ("images", "text")
        }
        step |= {f"{key}_per_generated_token/{k}": v[key] for k, v in per_token.items()}
        step[f"{key}/images_over_text"] = ratio(per_token, key)
    print(json.dumps(step | {"goal": 1.3}), flush=True)


def ratio(medians: dict[str, dict[str, float]], key: str) -> float:
    return medians["images"][key] / medians["text"][key]


def measure(
    runs: dict[str, Callable[[], int]], rounds: int, warmup: int
) -> dict[str, dict[str, float]]:
    """Each kind's median CPU seconds, wall seconds and tokens over ``rounds`` alternating
    rounds, the first ``warmup`` left out."""
    samples: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in runs}
    for _ in range(rounds):
        for kind, run in runs.items():
            samples[kind].append(timed(run))
    return {
        kind: {
            key: float(statistics.median(s[i] for s in taken[warmup:]))
            for i, key in enumerate(("cpu_s", "wall_s", "tokens"))
        }
        for kind, taken in samples.items()
    }


if __name__ == "__main__":
    main()
