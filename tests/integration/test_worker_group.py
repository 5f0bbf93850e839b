"""WorkerGroup on a real local Ray cluster, in colocated and split placement (shared mode: the
environments are not the point here)."""

from __future__ import annotations

import pytest
from workers import TESTS_DIR, EchoWorker

from tandem.cluster.placement import create_placement
from tandem.cluster.ray_cluster import interface_of
from tandem.cluster.worker_group import WorkerError, WorkerGroup

pytestmark = pytest.mark.ray
ENV = {"PYTHONPATH": TESTS_DIR}


def _group(num: int, kind: str = "trainer", **kwargs) -> WorkerGroup:
    return WorkerGroup(EchoWorker, num, kind, env_vars=ENV, env_mode="shared", **kwargs)


@pytest.mark.parametrize("mode", ["colocated", "split"])
def test_fan_out_gather_and_per_rank(ray_cluster: None, mode: str) -> None:
    placement = create_placement(mode, num_trainers=2, num_generators=2, cpus_per_actor=0.5)
    trainers = _group(2, kwargs={"scale": 10}, bundles=placement.trainer_bundles)
    generators = _group(2, "generator", bundles=placement.generator_bundles)
    try:
        infos = trainers.run("info")
        assert [i["rank"] for i in infos] == [0, 1]
        assert {i["world_size"] for i in infos} == {2}
        assert [i["env"]["RANK"] for i in infos] == ["0", "1"]
        assert [i["env"]["LOCAL_RANK"] for i in infos] == ["0", "1"]  # one node
        assert {i["env"]["MASTER_ADDR"] for i in infos} == {"127.0.0.1"}
        assert {i["node_ip"] for i in infos} == {"127.0.0.1"}  # where a refit's store listens
        # gloo, NCCL and vLLM listen on loopback too
        assert {i["env"]["VLLM_HOST_IP"] for i in infos} == {"127.0.0.1"}
        assert {i["env"]["GLOO_SOCKET_IFNAME"] for i in infos} == {interface_of("127.0.0.1")}
        assert {i["env"]["NCCL_SOCKET_IFNAME"] for i in infos} == {interface_of("127.0.0.1")}
        assert len({i["env"]["MASTER_PORT"] for i in infos}) == 1
        assert len({i["pid"] for i in infos}) == 2
        # the actor's start (Ray, the worker's module) ran without the collector, and its heap
        # is frozen: collections skip it (``imports.without_gc``)
        assert all(i["gc_enabled"] for i in infos)
        assert min(i["gc_frozen"] for i in infos) > 50_000

        group_id = placement.placement_group.id.hex()
        assert {i["placement_group"] for i in infos + generators.run("info")} == {group_id}
        num_bundles = len(placement.placement_group.bundle_specs)
        assert num_bundles == (2 if mode == "colocated" else 4)
        slots = placement.trainer_bundles + placement.generator_bundles
        assert [s.bundle_index for s in slots] == (
            [0, 1, 0, 1] if mode == "colocated" else [0, 1, 2, 3]
        )

        assert trainers.run("add", 3) == [30, 31]
        assert trainers.run_per_rank("add", [(1,), (2,)]) == [10, 21]
        assert trainers.run_rank0("add", 5) == 50
        futures = generators.run_async("add", 7)
        assert generators.get(futures) == [7, 8]
        # The rendezvous variables are enough for a real process group.
        assert trainers.run("all_reduce", 1.5) == [3.0, 3.0]
    finally:
        trainers.shutdown()
        generators.shutdown()
        placement.remove()


def test_method_exception_names_rank_and_method(ray_cluster: None) -> None:
    group = _group(2)
    try:
        with pytest.raises(WorkerError, match=r"trainer worker rank 1 failed in fail\(\)") as err:
            group.run("fail", "boom 42", only_rank=1)
        assert "ValueError: boom 42" in str(err.value)
        assert (err.value.kind, err.value.rank, err.value.method) == ("trainer", 1, "fail")
        assert group.run("add", 1) == [1, 2]  # the actors survive a raising method
    finally:
        group.shutdown()


def test_running_out_of_device_memory_names_the_settings_not_the_traceback(
    ray_cluster: None,
) -> None:
    for kind, setting in [("trainer", "policy.micro_batch_size"), ("generator", "max_tokens")]:
        group = _group(2, kind)
        try:
            with pytest.raises(WorkerError, match=rf"{kind} worker rank 1 failed") as err:
                group.run("run_out_of_memory", 1)
            message = str(err.value)
            tried = "out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
            assert tried in message
            assert setting in message and "cluster.memory_phases" in message
            assert "Traceback" not in message and "\n" not in message
            assert group.run("add", 1) == [1, 2]
        finally:
            group.shutdown()


def test_a_setting_that_cannot_work_is_one_message(ray_cluster: None) -> None:
    group = _group(2)
    try:
        with pytest.raises(WorkerError) as err:
            group.run("misconfigured", 1)
        message = str(err.value)
        assert message == (
            "trainer worker rank 1 failed in misconfigured(): policy: the trainer's state does "
            "not fit its GPU: ..."
        )
        assert err.value.from_setting
        with pytest.raises(WorkerError) as bug:
            group.run("fail", "boom", only_rank=0)
        assert not bug.value.from_setting
    finally:
        group.shutdown()


def test_dead_actor_raises_worker_error(ray_cluster: None) -> None:
    # The process exits inside the call (deterministic, unlike ray.kill, whose kill request can
    # reach the actor after a task submitted behind it has already run).
    group = _group(2, "generator")
    try:
        with pytest.raises(WorkerError, match=r"generator worker rank 1 failed in exit\(\)") as err:
            group.run("exit", 1)
        assert "actor died" in str(err.value)
        with pytest.raises(WorkerError, match=r"rank 1 failed in add\(\): actor died"):
            group.run("add", 1)  # later calls name the dead rank too
    finally:
        group.shutdown()


def test_failing_constructor_is_reported(ray_cluster: None) -> None:
    with pytest.raises(WorkerError, match=r"EchoWorker.__init__\(\).*constructor asked to fail"):
        _group(1, kwargs={"fail": True})
