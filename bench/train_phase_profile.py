"""Where the train phase's time goes at real vocabulary: PolicyTrainer.train on a random model
of a real Qwen2.5 shape (vocabulary 151,936), ``--sequences`` x ``--length`` tokens, under a
few policy settings (fp32 masters + bf16 compute via FSDP2 with activation checkpointing, as the
end-to-end cells run; without checkpointing; bf16 parameters on the plain module; ``_compile``:
an FSDP2 setting with its decoder layers compiled, the untimed first step compiling). One JSON
line per setting (median step seconds, MFU against the bf16 matmul rate of the same run) and, with
``--profile DIR``, the profiler's table of one step per setting.

``--spread``: every step gets new rows of random lengths (``--length`` at most, the loop's mix of
short and long responses), so its micro-batches take shapes not seen before, as in the loop;
``--sdpa flash|cudnn|efficient`` puts that attention kernel first (``sdpa_kernel``'s priority;
cuDNN's builds a graph for every new shape).

    PYTHONPATH=src:bench python bench/train_phase_profile.py [--shape 0.5b] [--profile DIR]
        [--spread] [--sdpa flash]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ceilings import emit, measure_ceilings
from real_scale_figures import model_sizes

from tandem.algorithms.losses import nll_loss
from tandem.assets.real_shapes import real_shape_dir, write_real_shape
from tandem.config.models import PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.trainer import PolicyTrainer

SETTINGS = {
    "fsdp_mp_ac": dict(mixed_precision=True, activation_checkpointing=True),
    "fsdp_mp": dict(mixed_precision=True, activation_checkpointing=False),
    "bf16_plain_ac": dict(dtype="bfloat16", activation_checkpointing=True),
    "fsdp_mp_ac_compile": dict(mixed_precision=True, activation_checkpointing=True, compile=True),
    "fsdp_mp_compile": dict(mixed_precision=True, activation_checkpointing=False, compile=True),
    "fsdp_mp_ac_pack": dict(mixed_precision=True, activation_checkpointing=True, packing=True),
}

SDPA = {
    "flash": [
        torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
        torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
        torch.nn.attention.SDPBackend.MATH,
    ],
    "cudnn": [
        torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
        torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
        torch.nn.attention.SDPBackend.MATH,
    ],
    "efficient": [
        torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
        torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
        torch.nn.attention.SDPBackend.MATH,
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--profile", default=None)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (CPU dry runs)")
    parser.add_argument("--spread", action="store_true", help="new random lengths every step")
    parser.add_argument("--sdpa", choices=sorted(SDPA), default=None, help="attention kernel first")
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "tandem-e2e"
    cuda = torch.cuda.is_available()
    name = real_shape_dir(args.shape, layers=args.layers)
    path = write_real_shape(
        root / name, args.shape, num_layers=args.layers, device="cuda" if cuda else "cpu"
    )
    peak = measure_ceilings()["bf16_matmul_tflop_s"] * 1e12 if cuda else float("nan")
    sync = torch.cuda.synchronize if cuda else lambda: None
    sizes = model_sizes(path)
    batches = [make_batch(args, seed) for seed in range(args.steps + 1 if args.spread else 1)]

    def flops_of(batch: TrainBatch) -> float:
        lengths = batch.attention_mask.sum(1).double()
        per_row = 6 * sizes["matmul_params"] + 6 * sizes["layers"] * sizes["hidden"] * lengths
        return float((lengths * per_row).sum())

    tokens = sum(int(b.attention_mask.sum()) for b in batches[-args.steps :]) // len(
        batches[-args.steps :]
    )
    kernel = (
        torch.nn.attention.sdpa_kernel(SDPA[args.sdpa], set_priority=True)
        if args.sdpa
        else contextlib.nullcontext()
    )
    with kernel:
        run_settings(args, path, batches, flops_of, tokens, peak, sync, cuda)


def make_batch(args: argparse.Namespace, seed: int) -> TrainBatch:
    """``--sequences`` rows: ``--length`` tokens each, or with ``--spread`` lengths drawn from an
    exponential of mean ``--length`` / 2 (at least 64, at most ``--length``); 32 prompt tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151_000, (args.sequences, args.length), generator=generator)
    lengths = torch.full((args.sequences,), args.length)
    if args.spread:
        drawn = torch.empty(args.sequences).exponential_(2 / args.length, generator=generator)
        lengths = drawn.long().clamp(64, args.length)
    attention = (torch.arange(args.length)[None] < lengths[:, None]).long()
    mask = attention.float()
    mask[:, :32] = 0  # a prompt
    return TrainBatch(ids, attention, mask)


def run_settings(args, path, batches, flops_of, tokens, peak, sync, cuda) -> None:  # type: ignore[no-untyped-def]
    for name in args.settings:
        config = PolicyConfig(
            model_path=path,
            micro_batch_size=args.micro_batch_size,
            max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
            **SETTINGS[name],
        )
        trainer = PolicyTrainer(config)
        start = time.perf_counter()
        trainer.train(batches[0], nll_loss)  # untimed: warms up (compiles the layers, if it does)
        sync()
        first_s = time.perf_counter() - start
        times, mfus = [], []
        for step in range(args.steps):
            batch = batches[step + 1 if args.spread else 0]
            sync()
            start = time.perf_counter()
            trainer.train(batch, nll_loss)
            sync()
            times.append(time.perf_counter() - start)
            mfus.append(flops_of(batch) / times[-1] / peak)
        seconds = statistics.median(times)
        emit(
            {
                "figure": "train_phase",
                "shape": args.shape,
                "setting": name,
                "spread": args.spread,
                "sdpa": args.sdpa or "default",
                "tokens": tokens,
                "micro_batch": [args.micro_batch_size, args.max_tokens_per_micro_batch],
                "step_s": round(seconds, 3),
                "first_step_s": round(first_s, 1),
                "mfu": round(statistics.median(mfus), 3),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            }
        )
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trainer.train(batches[-1], nll_loss)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
            Path(args.profile, f"{name}.txt").write_text(table)
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
