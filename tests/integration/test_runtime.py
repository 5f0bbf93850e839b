"""The Runtime's fan-out and failure handling on a real Ray cluster. The transformers backend
keeps the engines cheap: what is tested is the runtime, not vLLM (test_refit_e2e.py runs vLLM)."""

from __future__ import annotations

import os

import pytest
import ray
from ray.util.placement_group import placement_group_table

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.launch import KEEP_FREED_HOST_MEMORY, start_runtime
from tandem.cluster.spec import RuntimeSpec
from tandem.cluster.worker_group import WorkerError
from tandem.config.models import ClusterConfig, GenerationConfig, PolicyConfig, RefitConfig
from tandem.generation import SamplingParams, make_generator
from tandem.generation.hf_generator import HfGenerator

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPTS = ["17+25=", "3-1=", "99+99=", "40+2=", "8*8="]


def _spec(num_generators: int) -> RuntimeSpec:
    cluster = ClusterConfig(
        placement="split",
        num_trainers=1,
        num_generators=num_generators,
        cpus_per_actor=1.0,
        env_mode="shared",
    )
    return RuntimeSpec(cluster, PolicyConfig(), GenerationConfig(backend="hf"), RefitConfig())


def test_generate_fans_out_and_a_killed_generator_is_named(
    ray_cluster: None, caplog: pytest.LogCaptureFixture
) -> None:
    local = make_generator(GenerationConfig(backend="hf"), DEFAULT_MODEL_DIR)
    assert isinstance(local, HfGenerator)
    prompts = [local.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    expected = local.generate(prompts, GREEDY)

    runtime = start_runtime(_spec(num_generators=2))
    group_id = runtime.placement.placement_group.id.hex()
    trainer_actors = list(runtime.trainers.actors)
    assert runtime.engine_shutdown is False  # an engine on a CPU ends with its actor's kill
    try:
        # the actors of a CPU machine keep the memory they free (KEEP_FREED_HOST_MEMORY)
        for actor in [*trainer_actors, *runtime.generators.actors]:  # type: ignore[union-attr]
            env = ray.get(actor.__ray_call__.remote(lambda host: dict(os.environ)))
            assert {k: env.get(k) for k in KEEP_FREED_HOST_MEMORY} == KEEP_FREED_HOST_MEMORY
        # 5 prompts over 2 engines (3 + 2): rollouts come back in prompt order, indices global
        rollouts = runtime.generate(prompts, GREEDY)
        assert [r.prompt_index for r in rollouts] == list(range(len(PROMPTS)))
        assert [r.response_token_ids for r in rollouts] == [r.response_token_ids for r in expected]

        ray.kill(runtime.generators.actors[1])  # type: ignore[union-attr]
        with pytest.raises(WorkerError) as err:
            runtime.generate(prompts, GREEDY)
        failed = (err.value.kind, err.value.rank, err.value.method)
        assert failed == ("generator", 1, "generate_timed")
        message = "generator worker rank 1 failed in generate_timed(): actor died"
        assert str(err.value).startswith(message)
    finally:
        runtime.engine_shutdown = True  # as on GPUs: the engines first, one of them dead
        runtime.close()  # must not stop at the dead generator
    assert "generator worker rank 1 failed in shutdown()" in caplog.text
    assert placement_group_table()[group_id]["state"] == "REMOVED"
    for actor in trainer_actors:  # the trainers were killed too, not left holding CPUs
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.address.remote(), timeout=30)
