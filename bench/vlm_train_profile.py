"""Where a vision-language train step's time goes on the GPU: ``PolicyTrainer.train`` alone (no
generator, no Ray) on rows with images and on text rows of as many tokens, the trainer set up
as ``bench/vlm_gpu.py``'s loop sets it (fp32 masters + bf16 compute through FSDP2, activation
checkpointing, micro-batches of 16 rows), on a random Qwen2.5-VL of the 3B shape.

One JSON line per case: median seconds of a train step, micro-batches planned, the device's
busy seconds in that step (kernels' summed time: far below the step's seconds means the host
launches too slowly), the allocator's retries (a retry frees every cached block and calls
cudaMalloc again) and the peak; the ratio images/text. With ``--profile DIR`` the profiler's
tables of one step per case (by device time, with input shapes: the tower's width is 1280,
the language model's 2048).

    PYTHONPATH=.gpu/site:src:bench python bench/vlm_train_profile.py [--profile DIR]
    PYTHONPATH=src:bench python bench/vlm_train_profile.py --shape narrow   # a CPU check
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from ceilings import emit
from vlm_train_calls import batch, narrow_vl


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["3b", "narrow"], default="3b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=Path, default=None)
    args = parser.parse_args()
    from tandem.algorithms.losses import nll_loss
    from tandem.config.models import OptimizerConfig, PolicyConfig
    from tandem.trainer import PolicyTrainer

    cuda = torch.cuda.is_available()
    if args.shape == "3b":
        from vlm_gpu import model_folder

        model = model_folder("3b")
    else:
        model = narrow_vl()
    config = PolicyConfig(
        model_path=model,
        micro_batch_size=args.micro_batch_size,
        mixed_precision=cuda,
        activation_checkpointing=True,
        optimizer=OptimizerConfig(lr=1e-6),
    )
    trainer = PolicyTrainer(config)
    seconds: dict[str, float] = {}
    for case in ("text", "images"):
        data = batch(model, args, case == "images")
        planned = trainer._micro_batches(data)
        trainer.train(data, nll_loss)  # warm-up
        synchronize()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            trainer.train(data, nll_loss)
            synchronize()
            times.append(time.perf_counter() - start)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            trainer.train(data, nll_loss)
            synchronize()
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6 if cuda else float("nan")
        seconds[case] = statistics.median(times)
        record = {
            "figure": "vlm_train_profile",
            "rows": case,
            "shape": args.shape,
            "train_s": round(seconds[case], 3),
            "spread_s": [round(t, 3) for t in times],
            "micro_batches": len(planned),
            "rows_per_micro_batch": [len(mb.rows) for mb, _ in planned],
            "tokens_per_row": int(data.input_ids.shape[1]),
            "device_busy_s": round(busy, 3),
            "host_cpu_s": round(sum(e.self_cpu_time_total for e in events) / 1e6, 3),
            "alloc_retries": (
                torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries if cuda else 0
            ),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        }
        emit(record)
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            by_shape = prof.key_averages(group_by_input_shape=True)
            (args.profile / f"vlm_train_{case}.txt").write_text(
                events.table(sort_by=key, row_limit=40)
                + "\n\n"
                + by_shape.table(sort_by=key, row_limit=40, max_name_column_width=40)
            )
    emit(
        {
            "figure": "vlm_train_profile_ratio",
            "shape": args.shape,
            "images_over_text_train_s": round(seconds["images"] / seconds["text"], 2),
        }
    )


if __name__ == "__main__":
    main()
