"""Colocated refit (CUDA IPC, one GPU, two processes) vs device copy bandwidth.

The sender streams random bf16 GPU tensors shaped like a Qwen2 1.5B / 8B model (names and
shapes from a ``Qwen2Config`` on the meta device; nothing touches disk), laid out as a
trainer's after ``onload()`` (``trainer_like_state``). A receiver in a spawned process copies
every tensor into parameters it preallocated on the same GPU, as
``HfGenerator.receive_weights`` does (``RefitReceiver.copy_into``; the parameters laid out as
``HfGenerator`` lays out its own, and their ``TargetRuns`` kept across refits), and returns a
checksum and its number of copies.

The clock runs from ``send()`` until every byte has landed, with the receiver holding the spec
(``spec_handoff_ms``: the queue that carries it here, a Ray call in tandem, is timed apart). The
receiver starts as it gets the spec, about when ``send()`` starts; in a live refit it then maps
the trainer's memory that ``prepare()`` named (``prepare_ms``, also timed apart: planning the
buckets and finding the allocations of the live tensors).
The ceiling is the faster of two one-process copies of the same tensors into twins laid out as
the receiver's (payload bytes / s): ``dst.copy_(src)`` per tensor, and ``copy_tensors`` of all
of them (between two such layouts: a few byte copies, near the bulk device copy). A packed
refit copies every byte twice (into a bucket, then out of it), so its ideal is about half of
that; a live one (``prepare(metas, live_tensors=...)`` then ``send()``: the trainer's own
parameters) is read in place: one copy.

    PYTHONPATH=src python bench/refit_gpu.py [--models 1.5b 8b] [--buckets-mib 64 512 1024 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp
from ceilings import QWEN_1P5B, QWEN_8B, emit, measure_ceilings, qwen2_config

from tandem.tensors import TargetRuns, copy_tensors, device_copies
from tandem.tensors.devices import reserve_segment
from tandem.weight_sync import TensorMeta, make_receiver, make_sender

SHAPES = {"1.5b": QWEN_1P5B, "8b": QWEN_8B}


def metadata(shape: dict[str, Any]) -> list[TensorMeta]:
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(qwen2_config(shape))
    tied = shape["tie_word_embeddings"]
    return [
        TensorMeta(name, tuple(t.shape), torch.bfloat16)
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    ]


def trainer_like_state(metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """Random tensors on the GPU, laid out as a trainer's parameters after ``onload()``: back to
    back in one allocation (``device_copies``) carved from one reserved segment."""
    device = torch.device("cuda")
    sources = [torch.randn(m.shape, device=device, dtype=m.dtype) for m in metas]
    reserve_segment(device, sum(m.num_bytes for m in metas))
    state = dict(zip([m.name for m in metas], device_copies(sources, device), strict=True))
    del sources
    torch.cuda.synchronize()
    return state


def generator_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` laid out as ``HfGenerator`` lays out its parameters."""
    return device_copies(tensors, torch.device("cuda"))


def generator_params(metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """Zeroed parameters of ``metas`` laid out as ``HfGenerator`` lays out its own."""
    zeros = [torch.zeros(m.shape, dtype=m.dtype, device="cuda") for m in metas]
    return dict(zip([m.name for m in metas], generator_like(zeros), strict=True))


def checksum(tensors: Any) -> float:
    return float(sum(t.float().sum(dtype=torch.float64) for t in tensors))


def _receiver(specs: Any, results: Any) -> None:
    torch.cuda.set_device(0)
    results.put("ready")
    params: dict[str, torch.Tensor] = {}
    targets = TargetRuns([])
    while (message := specs.get()) is not None:
        metas, spec = message
        if set(params) != {m.name for m in metas}:
            params, targets = {}, TargetRuns([])
            torch.cuda.empty_cache()
            params = generator_params(metas)
            targets = TargetRuns([params[m.name] for m in metas])  # kept, as HfGenerator does
        results.put("receiving")
        copies = make_receiver(spec, "cuda:0").copy_into(targets)
        torch.cuda.synchronize()
        results.put((checksum(params[m.name] for m in metas), copies))


@contextlib.contextmanager
def receiver_process(target: Callable[[Any, Any], None]) -> Iterator[tuple[Any, Any]]:
    """A spawned receiver ``target(specs, results)`` that puts "ready" first, then answers each
    message on ``specs`` until it gets None; yields the two queues."""
    ctx = mp.get_context("spawn")
    specs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(specs, results))
    proc.start()
    try:
        assert results.get(timeout=120) == "ready"
        yield specs, results
    finally:
        specs.put(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def timed(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Best wall seconds of ``fn`` (synchronized before and after)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def copy_ceiling(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Payload GB/s of copying every tensor into a preallocated twin laid out as the receiver's
    parameters (best of 3), per tensor and with ``copy_tensors``."""
    srcs = list(state.values())
    dsts = generator_like(srcs)
    num_bytes = sum(t.numel() * t.element_size() for t in srcs)

    def per_tensor() -> None:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)

    return {
        "per_tensor": num_bytes / timed(per_tensor) / 1e9,
        "copy_tensors": num_bytes / timed(lambda: copy_tensors(dsts, srcs)) / 1e9,
    }


def bench_model(
    label: str, buckets_mib: list[int], specs: Any, results: Any, bulk_payload_gb_s: float
) -> None:
    metas = metadata(SHAPES[label])
    state = trainer_like_state(metas)
    expected = checksum(state.values())
    ceilings = copy_ceiling(state)
    ceiling = max(ceilings.values())
    num_bytes = sum(m.num_bytes for m in metas)
    emit(
        {
            "figure": "device_copy_payload_gb_s",
            "model": label,
            "value": round(ceiling, 1),
            **{f"{k}_gb_s": round(v, 1) for k, v in ceilings.items()},
        }
    )
    runs_of = [(mib, False) for mib in buckets_mib] + [(m, True) for m in buckets_mib if m >= 512]
    for mib, live in runs_of:
        config = SimpleNamespace(transport="colocated", bucket_bytes=mib * 2**20)
        sender = make_sender(config, "cuda:0", timeout_s=300)  # type: ignore[arg-type]
        runs, handoffs, prepares, copies = [], [], [], 0
        for _ in range(3):  # the first also opens the IPC handles and warms the allocator
            start = time.perf_counter()
            spec = sender.prepare(metas, live_tensors=state.values() if live else ())
            prepares.append(time.perf_counter() - start)
            start = time.perf_counter()
            specs.put((metas, spec))
            assert results.get(timeout=300) == "receiving"
            handoffs.append(time.perf_counter() - start)
            runs.append(sender.send() if live else sender.send(iter(state.items())))
            got, copies = results.get(timeout=300)
            assert got == expected, f"receiver checksum {got} != {expected}"
        sender.close()
        i = max(range(1, len(runs)), key=lambda i: runs[i].gb_per_s)
        best = runs[i]
        emit(
            {
                "figure": "refit_gb_s",
                "model": label,
                "live": live,
                "in_place": round(best.in_place_bytes / num_bytes, 3),
                "gb": round(num_bytes / 1e9, 2),
                "bucket_mib": mib,
                "num_buckets": best.num_buckets,
                "receiver_copies": copies,
                "value": round(best.gb_per_s, 1),
                "ms": round(best.seconds * 1e3, 2),
                "attach_ms": round(best.attach_seconds * 1e3, 2),
                "finish_ms": round(best.finish_seconds * 1e3, 2),
                "first_refit_gb_s": round(runs[0].gb_per_s, 1),
                "spec_handoff_ms": round(min(handoffs[1:]) * 1e3, 2),
                "prepare_ms": round(min(prepares[1:]) * 1e3, 2),
                "ceiling_device_copy_gb_s": round(ceiling, 1),
                "ratio": round(best.gb_per_s / ceiling, 3),
                "ratio_to_per_tensor_copy": round(best.gb_per_s / ceilings["per_tensor"], 3),
                "ratio_to_bulk_copy": round(best.gb_per_s / bulk_payload_gb_s, 3),
                # prepare() runs before send() and, live, plans what is read in place
                "ratio_to_bulk_with_prepare": round(
                    num_bytes / (best.seconds + prepares[i]) / 1e9 / bulk_payload_gb_s, 3
                ),
            }
        )
    del state
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["1.5b", "8b"], choices=sorted(SHAPES))
    parser.add_argument("--buckets-mib", type=int, nargs="+", default=[64, 512, 1024, 2048])
    args = parser.parse_args()
    ceilings = measure_ceilings()
    emit({"figure": "d2d_copy_gb_s_read_plus_write", "value": round(ceilings["d2d_copy_gb_s"])})
    with receiver_process(_receiver) as (specs, results):
        for label in args.models:
            bench_model(label, args.buckets_mib, specs, results, ceilings["d2d_copy_gb_s"] / 2)


if __name__ == "__main__":
    main()
