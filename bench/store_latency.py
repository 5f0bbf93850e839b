"""How fast a refit signal crosses between two processes through a TCPStore (CPU only).

A client process waits for keys the server process sets 5 ms apart, either blocked in
``multi_get`` or polling ``check``; it reports when it saw each key. Prints, per way of waiting,
the median time from the ``set`` returning to the waiter seeing the key, the median ``set``, and
the round trip of a ``multi_get`` of a key that is already there: what each signal of a refit
costs (figures: docs/benchmarks/2026-12-03-gpu-refit-offload-mfu.md).

    PYTHONPATH=src:bench python bench/store_latency.py
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from ceilings import emit

NUM_KEYS = 60
WARMUP = 5


def _waiter(port: int, mode: str, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    results.put("ready")
    seen = []
    for i in range(NUM_KEYS):
        key = f"{mode}/{i}"
        if mode == "poll":
            while not store.check([key]):
                pass
        store.multi_get([key])
        seen.append(time.perf_counter())
    round_trips = []
    for _ in range(100):
        start = time.perf_counter()
        store.multi_get([f"{mode}/0"])
        round_trips.append(time.perf_counter() - start)
    results.put((seen, statistics.median(round_trips)))


def main() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    for mode in ("block", "poll"):
        results = ctx.Queue()
        proc = ctx.Process(target=_waiter, args=(server.port, mode, results))
        proc.start()
        assert results.get(timeout=60) == "ready"
        sets = []
        for i in range(NUM_KEYS):
            time.sleep(0.005)
            start = time.perf_counter()
            server.set(f"{mode}/{i}", "1")
            sets.append((start, time.perf_counter()))
        seen, round_trip = results.get(timeout=60)
        proc.join(timeout=30)
        pairs = list(zip(seen, sets, strict=True))[WARMUP:]
        emit(
            {
                "figure": "store_signal_us",
                "wait": mode,
                "value": round(statistics.median((s - end) * 1e6 for s, (_, end) in pairs)),
                "set_us": round(statistics.median((end - a) * 1e6 for _, (a, end) in pairs)),
                "round_trip_us": round(round_trip * 1e6),
            }
        )


if __name__ == "__main__":
    main()
