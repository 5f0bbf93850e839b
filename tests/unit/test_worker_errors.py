"""What a worker's failure says through the in-process groups (the Ray group's is tested in
tests/integration/test_worker_group.py): a bug keeps its exception; running out of device or
host memory names the settings to change instead."""

from __future__ import annotations

import pytest
import torch

from tandem.cluster.groups import InlineGroup, LocalGroup, WorkerError


class Worker:
    def __init__(self, error: BaseException):
        self.error = error

    def work(self) -> None:
        raise self.error


OOM = "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 79 GiB"


@pytest.mark.parametrize("group_type", [LocalGroup, InlineGroup])
@pytest.mark.parametrize(
    ("kind", "setting"),
    [("trainer", "policy.max_tokens_per_micro_batch"), ("generator", "prompts_per_step")],
)
def test_out_of_device_memory_names_what_to_change(group_type, kind: str, setting: str) -> None:
    group = group_type([Worker(torch.OutOfMemoryError(OOM))], kind)
    with pytest.raises(WorkerError) as err:
        group.run("work")
    message = str(err.value)
    assert message.startswith(f"{kind} worker rank 0 failed in work(): out of device memory (")
    assert "Tried to allocate 512.00 MiB)" in message and "total capacity" not in message
    assert setting in message and "cluster.memory_phases=false" in message


class Allocating:
    def work(self) -> None:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: more than any host's address space


@pytest.mark.parametrize("group_type", [LocalGroup, InlineGroup])
def test_out_of_host_memory_names_what_to_change(group_type) -> None:
    group = group_type([Allocating()], "trainer")
    with pytest.raises(WorkerError) as err:
        group.run("work")
    message = str(err.value)
    assert message.startswith("trainer worker rank 0 failed in work(): out of host memory (")
    assert "tried to allocate 1,048,576.00 GiB)" in message
    assert "policy.micro_batch_size" in message and "enforce fail" not in message


def test_another_failure_keeps_its_exception() -> None:
    group = LocalGroup([Worker(ValueError("bad batch"))], "trainer")
    with pytest.raises(WorkerError, match=r"failed in work\(\): ValueError: bad batch$"):
        group.run("work")
