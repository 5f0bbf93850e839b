"""Offload/onload throughput of a PolicyTrainer vs pinned copies measured in the same run.

A Qwen2.5-1.5B-shaped random model trained in fp32 (master weights) with AdamW: after one step
the device holds params + two fp32 moments, ~18.5 GB. ``offload()`` moves it all to pinned host
memory and ``onload()`` back; GB/s = those bytes / wall time of the call (including the final
synchronize and, for offload, handing the freed blocks back to the driver).

The host memory is pinned ahead (``PolicyTrainer.pin_offload_memory``, as the colocated runtime
does when it starts) while the trainer loads, trains and then waits ``--lead-s`` seconds, which
stand in for the first generation; the first offload then runs at pinned bandwidth too.
``--no-pin-ahead`` shows the old first cycle, which pinned its copies itself.

    PYTHONPATH=src python bench/offload.py [--cycles 3] [--setup plain|fsdp] [--lead-s 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from ceilings import QWEN_1P5B, emit, measure_ceilings, random_model_dir

from tandem.algorithms.losses import nll_loss
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.tensors.devices import release_device_caches
from tandem.trainer import PolicyTrainer


def device_state_bytes(trainer: PolicyTrainer) -> int:
    """Bytes of parameters and optimizer state that offload moves."""
    total = 0
    tensors = list(trainer.model.parameters())
    if trainer.optimizer is not None:
        tensors += [
            v
            for state in trainer.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        total += local.numel() * local.element_size()
    return total


def timed(fn: object) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--setup", choices=["plain", "fsdp"], default="plain")
    parser.add_argument("--lead-s", type=float, default=5.0, help="before the first offload")
    parser.add_argument("--no-pin-ahead", action="store_true")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    extra = {"mixed_precision": True} if args.setup == "fsdp" else {}
    config = PolicyConfig(
        model_path=random_model_dir(QWEN_1P5B),
        dtype="float32",
        micro_batch_size=1,
        optimizer=OptimizerConfig(lr=1e-5),
        **extra,
    )
    release_device_caches()  # the ceilings' cuBLAS workspace: offload would free it too
    baseline = torch.cuda.memory_allocated()
    trainer = PolicyTrainer(config, device="cuda:0")
    if not args.no_pin_ahead:
        trainer.pin_offload_memory()
    ids = torch.randint(0, 151936, (1, 512))
    trainer.train(TrainBatch(ids, torch.ones_like(ids), torch.ones(1, 512)), nll_loss)
    time.sleep(args.lead_s)
    num_bytes = device_state_bytes(trainer)
    for cycle in range(args.cycles):
        off = timed(trainer.offload)
        left = torch.cuda.memory_allocated()
        on = timed(trainer.onload)
        pool = trainer._host_pool
        common = {
            "setup": args.setup,
            "cycle": cycle,
            "gb": round(num_bytes / 1e9, 3),
            "pin_ahead_s": None if pool is None else round(pool.pin_seconds, 2),
            "lead_s": args.lead_s,
        }
        off_gb_s, on_gb_s = num_bytes / off / 1e9, num_bytes / on / 1e9
        emit(
            {
                "figure": "offload_gb_s",
                **common,
                "value": round(off_gb_s, 2),
                "ceiling_pinned_d2h_gb_s": round(ceilings["pinned_d2h_gb_s"], 2),
                "ratio": round(off_gb_s / ceilings["pinned_d2h_gb_s"], 3),
                "allocated_after_offload": left,
                "allocated_before_trainer": baseline,
            }
        )
        emit(
            {
                "figure": "onload_gb_s",
                **common,
                "value": round(on_gb_s, 2),
                "ceiling_pinned_h2d_gb_s": round(ceilings["pinned_h2d_gb_s"], 2),
                "ratio": round(on_gb_s / ceilings["pinned_h2d_gb_s"], 3),
            }
        )


if __name__ == "__main__":
    main()
