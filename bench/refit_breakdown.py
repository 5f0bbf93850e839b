"""Where a colocated refit's time goes on one GPU: the pieces a transport is made of, timed alone.

For the 8B shape (bf16 tensors on the GPU), in one process: one copy of every tensor (per
tensor, with ``_foreach_copy_``, with ``copy_tensors`` at three fused-size limits and between
two back-to-back layouts), pack +
unpack through two alternating 2 GiB slots (the two passes of a bucketed refit, without a
second process), allocating and freeing the slots. Across two processes: sharing every tensor
through CUDA IPC (sender cost), opening the handles, one copy of every tensor straight out of
the trainer's memory, and closing them.

    PYTHONPATH=src python bench/refit_breakdown.py [--model 8b] [--bucket-mib 2048]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from ceilings import emit
from refit_gpu import SHAPES, generator_like, metadata, timed
from torch.multiprocessing.reductions import reduce_tensor

from tandem.tensors.copies import coalesce, copy_tensors
from tandem.weight_sync import plan_buckets
from tandem.weight_sync.base import slot_layout
from tandem.weight_sync.buckets import pack_piece, unpack_bucket


def _child(handles: Any, shapes: Any, results: Any) -> None:
    torch.cuda.set_device(0)
    dsts = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for shape in shapes]
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        srcs = [rebuild(*args) for rebuild, args in handles]
        opened = time.perf_counter()
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
        torch.cuda.synchronize()
        copied = time.perf_counter()
        del srcs, src
        closed = time.perf_counter()
        results.put((opened - start, copied - opened, closed - copied))
    results.put(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--bucket-mib", type=int, default=2048)
    args = parser.parse_args()
    metas = metadata(SHAPES[args.model])
    srcs = [torch.randn(m.shape, device="cuda", dtype=m.dtype) for m in metas]
    dsts = [torch.empty_like(t) for t in srcs]
    num_bytes = sum(m.num_bytes for m in metas)

    def figure(name: str, seconds: float, **extra: Any) -> None:
        emit(
            {
                "figure": f"breakdown_{name}",
                "model": args.model,
                "ms": round(seconds * 1e3, 2),
                "payload_gb_s": round(num_bytes / seconds / 1e9, 1),
                **extra,
            }
        )

    def per_tensor() -> None:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)

    figure("copy_per_tensor", timed(per_tensor), num_tensors=len(srcs))
    figure("copy_foreach", timed(lambda: torch._foreach_copy_(dsts, srcs)))
    for limit_mib in (1, 4, 16):  # copy_tensors: fused up to the limit, one copy each above
        seconds = timed(lambda limit=limit_mib * 2**20: copy_tensors(dsts, srcs, limit))
        figure("copy_tensors", seconds, fused_max_mib=limit_mib)
    # Both sides back to back (a trainer after onload(), HfGenerator): the pairs coalesce.
    laid = [generator_like(srcs), generator_like(srcs)]
    seconds = timed(lambda: copy_tensors(laid[1], laid[0]))
    figure("copy_tensors_laid_out", seconds, runs=len(coalesce(laid[1], laid[0])))
    laid.clear()
    bulk = torch.empty(2, num_bytes, dtype=torch.uint8, device="cuda")
    figure("copy_bulk", timed(lambda: bulk[1].copy_(bulk[0])))
    bulk.untyped_storage().resize_(0)
    torch.cuda.empty_cache()

    plan = plan_buckets(metas, args.bucket_mib * 2**20)
    size, num_slots = slot_layout(plan)
    allocate = timed(lambda: torch.empty(size * num_slots, dtype=torch.uint8, device="cuda"))
    torch.cuda.empty_cache()

    def free_slots() -> None:
        whole = torch.empty(size * num_slots, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        del whole
        torch.cuda.empty_cache()

    figure("alloc_slots", allocate, bytes=size * num_slots)
    figure("alloc_and_free_slots", timed(free_slots))
    whole = torch.empty(size * num_slots, dtype=torch.uint8, device="cuda")
    slots = [whole[i * size : (i + 1) * size] for i in range(num_slots)]

    def pack_unpack(slots: list[torch.Tensor] = slots) -> None:
        partial: dict[int, torch.Tensor] = {}
        for i, bucket in enumerate(plan.buckets):
            for piece in bucket.pieces:
                pack_piece(slots[i % num_slots], piece, srcs[piece.tensor_index])
            for index, tensor in unpack_bucket(slots[i % num_slots], bucket, plan, partial):
                dsts[index].copy_(tensor)

    figure("pack_unpack_one_process", timed(pack_unpack), num_buckets=len(plan.buckets))
    whole.untyped_storage().resize_(0)
    torch.cuda.empty_cache()

    start = time.perf_counter()
    handles = [reduce_tensor(t) for t in srcs]
    figure("ipc_share_per_tensor", time.perf_counter() - start, num_tensors=len(srcs))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(handles, [m.shape for m in metas], results))
    proc.start()
    rows = []
    while (row := results.get(timeout=300)) is not None:
        rows.append(row)
    proc.join(timeout=60)
    opened, copied, closed = min(rows, key=lambda row: sum(row))
    figure("ipc_open_all", opened, num_tensors=len(srcs))
    figure("ipc_copy_from_trainer_memory", copied)
    figure("ipc_close_all", closed)
    figure("ipc_direct_total", opened + copied + closed)


if __name__ == "__main__":
    main()
