"""LoRA against full-parameter training on one device: a train step, the refit's bytes and time,
offload/onload, device memory per phase.

For each mode (``full``: every weight; ``lora``: rank ``--rank`` adapters on every linear
projection, the base frozen) it builds a ``TrainerWorker`` and a transformers ``GeneratorWorker``
in this process on a random model of a real Qwen2.5 shape (``tandem.assets.real_shapes``, the
151,936-token vocabulary), times ``--steps`` train steps on random tokens and as many refits
(the in-process copy: the trainer's weight stream loaded by the generator; LoRA sends the
adapters only, ``refit.lora=adapter``), and prints one JSON line per mode (medians of the steps
after the first) and one line of ratios (lora / full).

    PYTHONPATH=src python bench/lora.py [--shape 1.5b] [--rank 32] [--batch 8] [--seq 512]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.algorithms.losses import nll_loss
from tandem.assets.real_shapes import write_real_shape
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.config.lora import LoraConfig
from tandem.config.models import GenerationConfig, OptimizerConfig, PolicyConfig, RefitConfig
from tandem.data.batch import TrainBatch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _allocated() -> float:
    return float(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0.0


def _peak(reset: bool = True) -> float:
    if not torch.cuda.is_available():
        return 0.0
    peak = float(torch.cuda.max_memory_allocated())
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def _batch(size: int, length: int, vocab: int, seed: int) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, length), generator=generator)
    mask = torch.ones(size, length, dtype=torch.long)
    loss_mask = mask.float()
    loss_mask[:, : length // 4] = 0  # a prompt
    return TrainBatch(ids, mask, loss_mask)


class _Timer:
    """Seconds of a block, the device synchronised at both ends."""

    def __enter__(self) -> _Timer:
        _sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        _sync()
        self.seconds = time.perf_counter() - self.start


def _counted(stream: Any, sent: list[int]) -> Any:
    for name, tensor in stream:
        sent[0] += tensor.numel() * tensor.element_size()
        yield name, tensor


def _measure(
    trainer: TrainerWorker, generator: GeneratorWorker, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Per step: a train step, a refit (the trainer's stream loaded by the generator), an
    offload and an onload of the policy; seconds and device bytes of each."""
    figures: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        figures.setdefault(key, []).append(value)

    vocab = trainer.policy.lm.config.vocab_size
    for step in range(args.steps):
        batch = _batch(args.batch, args.seq, vocab, step)
        with _Timer() as timer:
            trainer.train(batch, nll_loss)
        add("train_step_s", timer.seconds)
        add("train_peak_bytes", _peak())
        sent = [0]
        with _Timer() as timer:
            generator.load_weights(_counted(trainer.weight_stream(), sent), step + 1)
        add("refit_s", timer.seconds)
        add("refit_bytes", float(sent[0]))
        add("refit_peak_bytes", _peak())
        with _Timer() as timer:
            trainer.set_residency(policy=False)
        add("offload_s", timer.seconds)
        add("allocated_after_offload_bytes", _allocated())
        with _Timer() as timer:
            trainer.set_residency(policy=True)
        add("onload_s", timer.seconds)
    return figures


def run_mode(model: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank) if mode == "lora" else None
    policy = PolicyConfig(
        model_path=model,
        dtype="bfloat16",
        micro_batch_size=args.micro_batch,
        activation_checkpointing=True,
        optimizer=OptimizerConfig(lr=1e-5),
        lora=lora,
    )
    generation = GenerationConfig(backend="hf", max_lora_rank=args.rank if lora else None)
    refit = RefitConfig(transport="colocated", lora="adapter")
    _peak()
    trainer = TrainerWorker(policy, refit, generation)
    generator = GeneratorWorker(generation, str(model))
    resident = _allocated()
    figures = _measure(trainer, generator, args)
    trained = sum(p.numel() for p in trainer.policy.model.parameters() if p.requires_grad)
    generator.shutdown()
    out: dict[str, Any] = {
        "figure": "lora_vs_full",
        "mode": mode,
        "rank": args.rank if lora else None,
        "trainable_params": trained,
        "resident_bytes_trainer_and_generator": resident,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    later = slice(1, None) if args.steps > 1 else slice(None)
    out.update({key: statistics.median(values[later]) for key, values in figures.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1.5b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["full", "lora"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model = write_real_shape(
            Path(tmp) / "model", args.shape, num_layers=args.layers, device=device
        )
        results = {}
        for mode in args.modes:
            results[mode] = run_mode(model, mode, args)
            print(json.dumps(results[mode] | {"shape": args.shape}), flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if {"full", "lora"} <= results.keys():
        full, lora = results["full"], results["lora"]
        ratios = {
            key: lora[key] / full[key]
            for key in ("train_step_s", "train_peak_bytes", "refit_s", "refit_bytes")
            if full[key]
        }
        print(json.dumps({"figure": "lora_over_full", "shape": args.shape, **ratios}), flush=True)


if __name__ == "__main__":
    main()
