"""Where one live colocated refit on a GPU spends its time, on both sides of the transport.

Wraps the colocated sender's and receiver's steps with timers (both processes read the same
monotonic clock) and prints, per refit, the summed phases and the merged timeline in ms from
the start of ``send()``: ``S`` the trainer's side, ``R`` the generator's. Diagnostic only: the
timers cost a few µs each, so totals are a little above ``bench/refit_gpu.py``'s.

    PYTHONPATH=src python bench/refit_timeline.py [--model 1.5b] [--bucket-mib 1024]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from types import SimpleNamespace
from typing import Any

import torch
from ceilings import emit
from refit_gpu import SHAPES, generator_params, metadata, receiver_process, trainer_like_state

from tandem.tensors import copies
from tandem.weight_sync import base, colocated, cuda, cuda_ipc, live, make_receiver, make_sender

SPANS: list[tuple[str, float, float]] = []
SENDER_STEPS = ("_attach", "publish", "wait_slot", "end", "close")
RECEIVER_STEPS = ("_attach", "_wait_bucket", "_slot", "_done_bucket", "_detach", "_end")


def timed(owner: Any, name: str, label: str = "") -> None:
    """Record a span (named ``label``, else ``name``) for every call of ``owner.name``."""
    fn = getattr(owner, name)
    label = label or name.lstrip("_")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS.append((label, start, time.perf_counter()))

    setattr(owner, name, wrapper)


def _receiver(specs: Any, results: Any) -> None:
    torch.cuda.set_device(0)
    for name in RECEIVER_STEPS:
        timed(cuda.CudaIpcReceiver, name)
    for name in ("open_segment", "close_segment"):
        timed(cuda, name)
    timed(colocated, "wait_signals")
    timed(live.InPlaceReader, "copy", "copy_runs")
    timed(copies.TargetRuns, "copy")
    timed(torch.cuda.Stream, "wait_event")
    results.put("ready")
    targets = None  # kept across refits, as HfGenerator keeps them
    while (message := specs.get()) is not None:
        metas, spec = message
        if targets is None:
            params = generator_params(metas)
            targets = copies.TargetRuns([params[m.name] for m in metas])
        SPANS.clear()
        make_receiver(spec, "cuda:0").copy_into(targets)
        results.put(list(SPANS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--bucket-mib", type=int, default=1024)
    parser.add_argument("--refits", type=int, default=3, help="after one warm-up refit")
    args = parser.parse_args()
    for name in SENDER_STEPS:
        timed(cuda._CudaRefit, name)
    timed(base._LiveTensors, "check_unmoved")
    timed(cuda_ipc.SegmentTable, "locate")
    with receiver_process(_receiver) as (specs, results):
        metas = metadata(SHAPES[args.model])
        state = trainer_like_state(metas)
        config = SimpleNamespace(transport="colocated", bucket_bytes=args.bucket_mib * 2**20)
        sender = make_sender(config, "cuda:0", timeout_s=300)  # type: ignore[arg-type]
        for refit in range(args.refits + 1):
            torch.cuda.synchronize()
            specs.put((metas, sender.prepare(metas, live_tensors=state.values())))
            time.sleep(0.2)  # the receiver is waiting for bucket 0 before the clock starts
            SPANS.clear()
            start = time.perf_counter()
            stats = sender.send()
            spans = [("S " + n, a, b) for n, a, b in SPANS]
            spans += [("R " + n, a, b) for n, a, b in results.get(timeout=300) if b > start]
            if refit > 0:
                report(args, stats, spans, start)
        sender.close()


def report(args: argparse.Namespace, stats: Any, spans: list[Any], start: float) -> None:
    """One JSON line of summed phases, then the steps in order."""
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for name, a, b in spans:
        totals[name] += (b - max(a, start)) * 1e3
        counts[name] += 1
    emit(
        {
            "figure": "refit_timeline",
            "model": args.model,
            "bucket_mib": args.bucket_mib,
            "ms": round(stats.seconds * 1e3, 2),
            "gb_s": round(stats.gb_per_s, 1),
            "phases_ms": {k: round(v, 2) for k, v in sorted(totals.items())},
            "calls": dict(sorted(counts.items())),
        }
    )
    steps = sorted(spans, key=lambda s: s[1])
    print(json.dumps([f"{n} {1e3 * (a - start):.2f}-{1e3 * (b - start):.2f}" for n, a, b in steps]))


if __name__ == "__main__":
    main()
