"""The HF generator on the GPU beside ``transformers.generate`` on the same batch.

A random Qwen2 of the 0.5B shape (bf16) with the embedded tokenizer generates 32 prompts x 8
samples of up to 128 tokens: tandem's decode with CUDA graphs, without them (static cache,
eager) and with the dynamic cache, and ``model.generate`` (sampling, its own dynamic cache),
alternating, ``--rounds`` times each. One JSON line per path: the median seconds, the tokens
per second, and the ratio to ``generate``.

``--model DIR`` takes a model folder instead (e.g. a real-vocabulary shape of
``tandem.assets.real_shapes``, as ``real_scale.py --sides decode`` does), ``--paths`` picks the
paths, among them ``tandem_whole_reads``: the decode as it was before its windows (every step
attends over the whole static cache, transformers' sdpa copying the grouped key/value heads).
``--roofline`` adds each path's tokens/s against the decode roofline of the same run
(``real_scale_figures.decode_roofline`` at the device-to-device copy rate). ``tandem_compiled``
is the graphed decode of a second generator whose decoder layers are compiled
(``generation.compile``); ``tandem_two_chunks`` decodes the rows in two halves one after the
other (as where the cache of every row to the cap does not fit the device);
``tandem_refit_mid`` is the graphed decode with a new weight version landing halfway (the same
weights: every row still decoding is prefilled again, as after an in-flight refit). Each line of
tandem's paths carries the decode's model call per step (``forward_ms_per_step``, the
generator's ``timing/decode_forward_s`` over its steps), its decode steps, parked rows and
prefills; on a GPU every line has the run's peak of allocated device memory (``peak_gb``).

    PYTHONPATH=src:bench python bench/hf_generate_gpu.py [--shape 0.5b] [--rounds 3]
        [--model DIR --max-tokens 2048 --paths tandem_cuda_graphs tandem_whole_reads --roofline]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from ceilings import emit, measure_ceilings
from real_scale_figures import decode_roofline, model_sizes

from tandem.assets import write_random_qwen2
from tandem.assets.real_shapes import QWEN25_SHAPES
from tandem.generation import SamplingParams, static_decode
from tandem.generation.hf_generator import HfGenerator

PATHS = ("tandem_cuda_graphs", "tandem_static_eager", "tandem_dynamic", "transformers_generate")
WHOLE = "tandem_whole_reads"
COMPILED = "tandem_compiled"
CHUNKS = "tandem_two_chunks"
REFIT = "tandem_refit_mid"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="0.5b", choices=QWEN25_SHAPES)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="a model folder to use")
    parser.add_argument(
        "--paths", nargs="+", default=list(PATHS), choices=[*PATHS, WHOLE, COMPILED, CHUNKS, REFIT]
    )
    parser.add_argument("--roofline", action="store_true")
    args = parser.parse_args()
    path = args.model or Path(tempfile.gettempdir()) / f"hfgen-qwen2-{args.shape}"
    if args.model is None:
        write_random_qwen2(path, QWEN25_SHAPES[args.shape], device="cuda")
    cuda = torch.cuda.is_available()  # (a CPU runs it too, as a check of the script)
    device = "cuda:0" if cuda else "cpu"
    bandwidth = measure_ceilings()["d2d_copy_gb_s"] if args.roofline and cuda else 0.0
    generator = HfGenerator(path, device=device, dtype="bfloat16")
    texts = [f"{a}+{b}=" for a, b in zip(range(11, 400, 3), range(7, 396, 3), strict=True)]
    prompts = [generator.tokenizer.encode(t) for t in texts][: args.prompts]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.generations)
    model, pad = generator.model, generator.pad_token_id
    attention = model.config._attn_implementation  # the generator's (grouped heads in place)

    compiled = None
    if COMPILED in args.paths:  # its layers compiled in place: a generator of its own
        compiled = HfGenerator(path, device=device, dtype="bfloat16", compile_layers=True)
    forward_ms: dict[str, float] = {}
    decoded: dict[str, float] = {}  # the last decode's take_stats

    def ours(graphs: bool, static: bool, whole: bool = False, warm: bool = False) -> int:
        generator.cuda_graphs, generator.static_cache = graphs and cuda, static
        static_decode.CACHE_BUCKET = 1 << 30 if whole else 256
        model.set_attn_implementation("sdpa" if whole else attention)
        return run_ours(generator, warm)

    def run_ours(gen: HfGenerator, warm: bool) -> int:
        run = replace(params, max_tokens=16) if warm else params
        gen.take_stats()
        tokens = sum(len(r.response_token_ids) for r in gen.generate(prompts, run))
        stats = gen.take_stats()
        decoded.update(stats)
        forward_ms["last"] = (
            1e3 * stats["timing/decode_forward_s"] / stats["throughput/decode_steps"]
        )
        return tokens

    def ours_compiled(warm: bool = False) -> int:
        assert compiled is not None
        compiled.cuda_graphs, compiled.static_cache = cuda, True
        static_decode.CACHE_BUCKET = 256
        return run_ours(compiled, warm)

    def transformers_generate(warm: bool = False) -> int:
        model.set_attn_implementation("sdpa")  # transformers' own attention
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = (
            torch.arange(width, device=device)[None]
            >= width - torch.tensor([len(p) for p in prompts], device=device)[:, None]
        ).long()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.repeat_interleave(args.generations, 0),
                attention_mask=mask.repeat_interleave(args.generations, 0),
                do_sample=True,
                max_new_tokens=16 if warm else args.max_tokens,
                pad_token_id=pad,
                top_k=0,
            )
        return int((out[:, width:] != pad).sum())

    def ours_two_chunks(warm: bool = False) -> int:
        """As the decode before its cache grew with its window where every row's cache to
        the cap did not fit: the rows in two chunks, one after the other."""
        limit = generator.max_batch_size
        generator.max_batch_size = max(1, len(prompts) * args.generations // 2)
        try:
            return ours(True, True, warm=warm)
        finally:
            generator.max_batch_size = limit

    def ours_refit_mid(warm: bool = False) -> int:
        """The graphed decode with the weights' version one higher from its middle step on:
        the generator prefills its rows again (the weights are the same, so are the tokens)."""
        gate: Any = generator.gate
        real, steps = gate.step, [0]
        half = (16 if warm else args.max_tokens) // 2

        @contextlib.contextmanager
        def step() -> Iterator[int]:
            with real() as version:
                steps[0] += 1
                yield version + (steps[0] > half)

        gate.step = step
        try:
            return ours(True, True, warm=warm)
        finally:
            gate.step = real

    every = {
        "tandem_cuda_graphs": lambda warm=False: ours(True, True, warm=warm),
        CHUNKS: ours_two_chunks,
        REFIT: ours_refit_mid,
        "tandem_static_eager": lambda warm=False: ours(False, True, warm=warm),
        "tandem_dynamic": lambda warm=False: ours(False, False, warm=warm),
        "transformers_generate": transformers_generate,
        WHOLE: lambda warm=False: ours(True, True, whole=True, warm=warm),
        COMPILED: ours_compiled,
    }
    paths = {name: every[name] for name in args.paths}
    sync = torch.cuda.synchronize if cuda else lambda: None
    for run in paths.values():  # warm-up (16 tokens: kernels and graphs, not the whole decode)
        run(warm=True)
    times: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, int] = {}
    step_ms: dict[str, list[float]] = {name: [] for name in paths}
    counts: dict[str, dict[str, int]] = {}  # decode steps, parked rows (the last round's)
    peaks: dict[str, list[int]] = {name: [] for name in paths}  # allocated device bytes
    for _ in range(args.rounds):
        for name, run in paths.items():
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            forward_ms.pop("last", None)
            tokens[name] = run()
            sync()
            times[name].append(time.perf_counter() - start)
            if cuda:
                peaks[name].append(torch.cuda.max_memory_allocated())
            if "last" in forward_ms:
                step_ms[name].append(forward_ms["last"])
                counts[name] = {
                    key.split("/decode_")[1]: int(decoded[key])
                    for key in (
                        "throughput/decode_steps",
                        "throughput/decode_parked",
                        "throughput/decode_prefills",
                    )
                }
    generate = times.get("transformers_generate")
    reference = statistics.median(generate) if generate else None
    rows = len(prompts) * args.generations
    prompt_mean = statistics.mean(len(p) for p in prompts)
    for name, values in times.items():
        median = statistics.median(values)
        record = {
            "figure": "hf_generate_s",
            "path": name,
            "shape": args.shape if args.model is None else args.model.name,
            "value": round(median, 3),
            "runs": [round(v, 3) for v in values],
            "tokens": tokens[name],
            "tokens_per_s": round(tokens[name] / median),
            "ratio_to_generate": round(median / reference, 3) if reference else None,
            "work": f"{args.prompts}x{args.generations}x<={args.max_tokens}",
        }
        if peaks[name]:
            record["peak_gb"] = round(max(peaks[name]) / 1e9, 2)
        if step_ms[name]:
            record["forward_ms_per_step"] = round(statistics.median(step_ms[name]), 3)
            record["decode"] = counts[name]
        if bandwidth:
            sizes = model_sizes(path)
            response = tokens[name] / rows
            ceiling = decode_roofline(sizes, rows, prompt_mean, response, bandwidth, 2)
            record["decode_roofline_tokens_per_s"] = round(ceiling)
            record["decode_roofline_fraction"] = round(tokens[name] / median / ceiling, 4)
            record["d2d_copy_gb_s"] = round(bandwidth, 1)
        emit(record)


if __name__ == "__main__":
    main()
