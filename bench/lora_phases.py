"""A LoRA policy's generate and train phases against the full model's, in one process.

On a random model of a real Qwen2.5 shape (151,936-token vocabulary, an EOS bias for a mean
length of 32 tokens) in bf16, a ``TrainerWorker`` (rank 32, alpha 64, every linear projection,
activation checkpointing, one micro-batch of ``--rows`` rows) and a transformers
``GeneratorWorker`` after one adapter refit time, for each mode (``lora``, ``full``):

- ``generate_s``: three generations of ``--rows`` rows (8 samples of each prompt, up to
  ``--tokens`` tokens), then two without CUDA graphs (``generate_no_graphs_s``);
- ``train_s``: train steps at response lengths 128, 128, 128, 96, 140, 77, 128, 111, 96 (does a
  new length cost more than a repeat?), two more after an offload and onload;
- ``logprobs_s``: two logprob passes (a forward alone).

``--mixed-precision`` trains with ``policy.mixed_precision`` (fp32 masters, bf16 compute: the
adapters' products in bf16 too). ``--profile``: a profiler table of one generate and one train
step per mode. One JSON line per mode; on a CPU it checks the script (``--shape 0.5b --layers 1
--rows 16 --tokens 8``).

    PYTHONPATH=src:bench python bench/lora_phases.py [--shape 1.5b] [--modes lora full]
        [--mixed-precision] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ceilings import emit

from tandem.algorithms.losses import nll_loss
from tandem.assets.real_shapes import write_real_shape
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.config.lora import LoraConfig
from tandem.config.models import (
    GenerationConfig,
    OptimizerConfig,
    PolicyConfig,
    RefitConfig,
    generator_dtype,
)
from tandem.data.batch import TrainBatch
from tandem.generation.base import SamplingParams

CUDA = torch.cuda.is_available()
LENGTHS = (128, 128, 128, 96, 140, 77, 128, 111, 96)
PROMPT = 30


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(call: Callable[..., Any], *args: Any) -> float:
    """Seconds of ``call(*args)``, the device synchronised at both ends."""
    _sync()
    start = time.perf_counter()
    call(*args)
    _sync()
    return round(time.perf_counter() - start, 4)


def batch(rows: int, length: int, vocab: int, seed: int) -> TrainBatch:
    """``rows`` rows of a ``PROMPT``-token prompt and a response of 4 to ``length`` tokens
    (the first row ``length``), right-padded; the loss on the responses."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, PROMPT + length), generator=generator)
    lengths = torch.randint(4, length + 1, (rows,), generator=generator)
    lengths[0] = length
    attention = (torch.arange(PROMPT + length)[None, :] < PROMPT + lengths[:, None]).long()
    loss_mask = attention.float()
    loss_mask[:, :PROMPT] = 0
    return TrainBatch(ids * attention, attention, loss_mask)


def profile(call: Callable[[], Any], title: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profiler(activities=activities) as prof:
        call()
        _sync()
    print(f"## {title}", flush=True)
    sort = "cuda_time_total" if CUDA else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20), flush=True)


def run_mode(model: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    lora = LoraConfig(rank=32, alpha=64) if mode == "lora" else None
    policy = PolicyConfig(
        model_path=model,
        dtype="bfloat16",
        mixed_precision=args.mixed_precision,
        micro_batch_size=args.rows,
        activation_checkpointing=True,
        optimizer=OptimizerConfig(lr=1e-4),
        lora=lora,
    )
    generation = GenerationConfig(backend="hf", max_lora_rank=32 if lora else None)
    generation = generation.model_copy(update={"dtype": generator_dtype(policy, generation)})
    trainer = TrainerWorker(policy, RefitConfig(transport="colocated", lora="adapter"), generation)
    generator = GeneratorWorker(generation, str(model))
    vocab = trainer.policy.lm.config.vocab_size
    generator.load_weights(trainer.weight_stream(), 1)  # LoRA: injects the adapter layers
    ids = torch.randint(0, 1000, (args.rows // 8, PROMPT), generator=torch.Generator())
    prompts = [row for row in ids.tolist() for _ in range(8)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=0)
    out: dict[str, Any] = {
        "figure": "lora_phases",
        "mode": mode,
        "mixed_precision": args.mixed_precision,
        "shape": args.shape,
        "rows": args.rows,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
    }
    out["generate_s"] = [timed(generator.generate, prompts, sampling) for _ in range(3)]
    engine: Any = generator.generator
    engine.cuda_graphs = False
    out["generate_no_graphs_s"] = [timed(generator.generate, prompts, sampling) for _ in range(2)]
    engine.cuda_graphs = CUDA
    out["train_s"] = [
        [length, timed(trainer.train, batch(args.rows, length, vocab, i), nll_loss)]
        for i, length in enumerate(LENGTHS)
    ]
    trainer.set_residency(policy=False)
    trainer.set_residency(policy=True)
    out["train_after_onload_s"] = [
        timed(trainer.train, batch(args.rows, 128, vocab, 50 + i), nll_loss) for i in range(2)
    ]
    out["logprobs_s"] = [
        timed(trainer.policy.logprobs, batch(args.rows, 128, vocab, 60 + i)) for i in range(2)
    ]
    if args.profile:
        profile(lambda: generator.generate(prompts, sampling), f"{mode} generate")
        profile(lambda: trainer.train(batch(args.rows, 128, vocab, 99), nll_loss), f"{mode} train")
    generator.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1.5b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        device = "cuda" if CUDA else "cpu"
        model = write_real_shape(Path(tmp) / "model", args.shape, 32.0, args.layers, device=device)
        for mode in args.modes:
            emit(run_mode(model, mode, args))
            gc.collect()
            if CUDA:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
