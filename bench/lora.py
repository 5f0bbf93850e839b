"""LoRA against full-parameter training on one device: a train step, the refit's bytes and time,
a generation, offload/onload, device memory per phase.

For each mode it builds a ``TrainerWorker`` and a transformers ``GeneratorWorker`` in this
process on a random model of a real Qwen2.5 shape (``tandem.assets.real_shapes``, the
151,936-token vocabulary), bf16 weights (the generator's too, as a run resolves them), and
times ``--steps`` rounds of: a train step on random tokens, a refit (the in-process copy: the
trainer's weight stream loaded by the generator), a generation (``--gen-prompts`` x
``--gen-tokens``), the trainer's offload and onload. Modes:

- ``full``: every weight trains; the refit sends every weight;
- ``lora``: rank ``--rank`` adapters (alpha 2 x rank) on every linear projection, the base
  frozen; the refit sends the adapters only (``refit.lora=adapter``, peft's layers on the
  generator); the offload moves the base too (``policy.lora.offload_base``, the default);
- ``lora_keep_base``: as ``lora``, the offload leaving the frozen base on the device
  (``policy.lora.offload_base=false``);
- ``lora_merged``: as ``lora``, the refit sending merged full weights (``refit.lora=merged``;
  the generator computes without adapters).

One JSON line per mode (medians of the rounds after the first; ``refit_back_to_back_s`` and
``refit_after_onload_s``: the refit alone, 20 in a row and 5 each after an offload and onload
of the trainer; device bytes per phase: the
trainer's and the generator's at build, the peaks of train, refit and generation, allocated
after the trainer's offload and the trainer's share of it; ``refit_data_calls``: the aten calls
that touch tensor data in one refit, a kernel launch or more each on a GPU, counted in one more
refit after the timed ones), then one line of each LoRA mode's
ratios to ``full`` with the goals (refit time <= 5 %, bytes <= 2 % of the full refit's).
``--tiny`` is a CPU check of the whole script on a one-layer 0.5B shape. Lines also go to
$BENCH_JSONL when set.

    PYTHONPATH=src:bench python bench/lora.py [--shape 1.5b] [--rank 32] [--batch 8] [--seq 512]
        [--modes full lora lora_keep_base lora_merged] [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from aten_calls import AtenCalls
from ceilings import emit

from tandem.algorithms.losses import nll_loss
from tandem.assets.real_shapes import write_real_shape
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.cluster.launch import keep_freed_host_memory
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
from tandem.tensors.packed import PackedStream

MODES = ("full", "lora", "lora_keep_base", "lora_merged")
GOALS = {"refit_s": 0.05, "refit_bytes": 0.02}
"""LoRA refit / full refit at rank 32 on the 1.5B shape: time, bytes."""


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
    """``stream`` with its bytes counted into ``sent``; a ``PackedStream`` (adapters in one
    tensor, which the generator copies at once) is passed on as it is."""
    if isinstance(stream, PackedStream):
        sent[0] += stream.nbytes
        return stream
    return _each_counted(stream, sent)


def _each_counted(stream: Any, sent: list[int]) -> Any:
    for name, tensor in stream:
        sent[0] += tensor.numel() * tensor.element_size()
        yield name, tensor


def _refit_data_calls(trainer: TrainerWorker, generator: GeneratorWorker, version: int) -> int:
    """The data calls of one more refit (untimed: counting slows the calls down)."""
    with AtenCalls() as calls:
        generator.load_weights(trainer.weight_stream(), version)
    return calls.count


def _refit_split(
    trainer: TrainerWorker, generator: GeneratorWorker, version: int
) -> dict[str, float]:
    """The refit alone: the median of 20 back to back (nothing moved in between) and of 5 each
    right after an offload and onload of the trainer (new addresses, an emptied cache)."""
    back_to_back, after_onload = [], []
    for i in range(20):
        with _Timer() as timer:
            generator.load_weights(trainer.weight_stream(), version + i)
        back_to_back.append(timer.seconds)
    for i in range(5):
        trainer.set_residency(policy=False)
        trainer.set_residency(policy=True)
        with _Timer() as timer:
            generator.load_weights(trainer.weight_stream(), version + 20 + i)
        after_onload.append(timer.seconds)
    return {
        "refit_back_to_back_s": statistics.median(back_to_back),
        "refit_after_onload_s": statistics.median(after_onload),
    }


def _measure(
    trainer: TrainerWorker, generator: GeneratorWorker, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Per step: a train step, a refit (the trainer's stream loaded by the generator), an
    offload and an onload of the policy; seconds and device bytes of each."""
    figures: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        figures.setdefault(key, []).append(value)

    vocab = trainer.policy.lm.config.vocab_size
    prompts = torch.randint(0, vocab, (args.gen_prompts, 16), generator=torch.Generator())
    sampling = SamplingParams(temperature=1.0, max_tokens=args.gen_tokens, seed=0)
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
            generator.generate(prompts.tolist(), sampling)
        add("generate_s", timer.seconds)
        add("generate_peak_bytes", _peak())
        with _Timer() as timer:
            trainer.set_residency(policy=False)
        add("offload_s", timer.seconds)
        add("allocated_after_offload_bytes", _allocated())
        with _Timer() as timer:
            trainer.set_residency(policy=True)
        add("onload_s", timer.seconds)
    return figures


def run_mode(model: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    keep_base = mode == "lora_keep_base"
    lora = (
        LoraConfig(rank=args.rank, alpha=2 * args.rank, offload_base=not keep_base)
        if mode != "full"
        else None
    )
    policy = PolicyConfig(
        model_path=model,
        dtype="bfloat16",
        micro_batch_size=args.micro_batch,
        activation_checkpointing=True,
        optimizer=OptimizerConfig(lr=1e-5),
        lora=lora,
    )
    generation = GenerationConfig(backend="hf", max_lora_rank=args.rank if lora else None)
    # the generator computes in the dtype a run gives it (the trainer's: bfloat16), so a refit
    # copies without a cast, as in a run (``launch.resolved_generation``)
    generation = generation.model_copy(update={"dtype": generator_dtype(policy, generation)})
    refit = RefitConfig(
        transport="colocated", lora="merged" if mode == "lora_merged" else "adapter"
    )
    _peak()
    before = _allocated()
    trainer = TrainerWorker(policy, refit, generation)
    built = _allocated()
    generator = GeneratorWorker(generation, str(model))
    resident = _allocated()
    figures = _measure(trainer, generator, args)
    data_calls = _refit_data_calls(trainer, generator, args.steps + 1)
    split = _refit_split(trainer, generator, args.steps + 2)
    trained = sum(p.numel() for p in trainer.policy.model.parameters() if p.requires_grad)
    generator.shutdown()
    out: dict[str, Any] = {
        "figure": "lora_vs_full",
        "mode": mode,
        "rank": args.rank if lora else None,
        "trainable_params": trained,
        "refit_data_calls": data_calls,
        **split,
        "resident_bytes_trainer_and_generator": resident,
        "trainer_bytes_at_build": built - before,
        "generator_bytes_at_load": resident - built,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    later = slice(1, None) if args.steps > 1 else slice(None)
    out.update({key: statistics.median(values[later]) for key, values in figures.items()})
    # the trainer's share of what stays after its offload (the generator's weights stay)
    out["trainer_after_offload_bytes"] = out["allocated_after_offload_bytes"] - (resident - built)
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
    parser.add_argument("--gen-prompts", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--tiny", action="store_true", help="a CPU check: one layer of 0.5B, small batches"
    )
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.layers, args.batch, args.micro_batch = "0.5b", 1, 2, 2
        args.seq, args.steps, args.gen_prompts, args.gen_tokens = 32, 2, 2, 4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # as a run's CPU process: freed host memory is reused, not faulted in
        keep_freed_host_memory()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_real_shape(
            Path(tmp) / "model", args.shape, num_layers=args.layers, device=device
        )
        results = {}
        for mode in args.modes:
            results[mode] = run_mode(model, mode, args)
            emit(results[mode] | {"shape": args.shape, "layers": args.layers})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for mode in [mode for mode in results if mode != "full" and "full" in results]:
        full, lora = results["full"], results[mode]
        keys = (
            "train_step_s",
            "train_peak_bytes",
            "refit_s",
            "refit_back_to_back_s",
            "refit_after_onload_s",
            "refit_bytes",
            "generate_s",
        )
        ratios = {key: round(lora[key] / full[key], 5) for key in keys if full[key]}
        goals = {f"{key}_goal": GOALS[key] for key in GOALS if mode != "lora_merged"}
        met = {f"{key}_met": ratios[key] <= GOALS[key] for key in GOALS if key in ratios}
        emit(
            {"figure": "lora_over_full", "mode": mode, "shape": args.shape, "rank": args.rank}
            | ratios
            | (goals | met if goals else {})
        )


if __name__ == "__main__":
    main()
