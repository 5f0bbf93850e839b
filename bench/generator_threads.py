"""A generator actor's generation time by how the actor takes its calls (CPU).

A generator actor that runs two calls at once (``algorithm.refit_mode=in_flight``) takes them on
alternating threads; once two threads of a process have run OpenMP regions, small ops on both
slow down. ``GeneratorWorker(compute_thread=True)`` (what ``launch_ray`` builds for in-flight
refit) keeps the engine's work on one thread of its own. Each variant is a fresh Ray actor in
the driver's interpreter with 2 intra-op threads, generating 8 prompts x 8 samples x <= 8 tokens
of the embedded model ``--calls`` times; the median after 5 warm-up calls, variants alternating
``--rounds`` times. One JSON line per variant and round, then the medians with the one-call
actor as the ceiling.

    ./run.sh python bench/generator_threads.py [--backend vllm|hf] [--rounds 2] [--calls 25]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ceilings import emit

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import GeneratorWorker
from tandem.cluster.ray_cluster import init_ray
from tandem.cluster.worker_group import WorkerGroup
from tandem.config.models import GenerationConfig
from tandem.generation.base import SamplingParams

VARIANTS = {  # name: (max_concurrency, compute_thread)
    "one_call": (1, False),
    "two_calls": (2, False),
    "two_calls_compute_thread": (2, True),
}


def generation_ms(backend: str, concurrency: int, compute_thread: bool, calls: int) -> float:
    generation = GenerationConfig(backend=backend, dtype="float32")
    group = WorkerGroup(
        GeneratorWorker,
        1,
        kind="generator",
        kwargs=dict(
            generation=generation, model_path=str(DEFAULT_MODEL_DIR), compute_thread=compute_thread
        ),
        env_mode="shared",
        env_vars={"OMP_NUM_THREADS": "2"},
        max_concurrency=concurrency,
    )
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]] * 8
    params = SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=0)
    try:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            group.run("generate", prompts, params)
            times.append(time.perf_counter() - start)
    finally:
        group.shutdown()
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=25)
    args = parser.parse_args()
    init_ray(num_cpus=2)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for index in range(args.rounds):
        for name, (concurrency, compute_thread) in VARIANTS.items():
            ms = generation_ms(args.backend, concurrency, compute_thread, args.calls)
            results[name].append(ms)
            emit({"figure": "generator_threads_run", "variant": name, "round": index, "ms": ms})
    ceiling = statistics.median(results["one_call"])
    for name, values in results.items():
        emit(
            {
                "figure": "generator_threads",
                "backend": args.backend,
                "variant": name,
                "median_ms": round(statistics.median(values), 1),
                "spread_ms": [round(min(values), 1), round(max(values), 1)],
                "one_call_ms": round(ceiling, 1),
                "ratio_to_one_call": round(statistics.median(values) / ceiling, 3),
            }
        )


if __name__ == "__main__":
    main()
