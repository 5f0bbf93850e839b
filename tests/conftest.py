"""Shared fixtures; under a parallel run, each worker on its own cores and the GPU tests in one
worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).parent / "gpu"


def _own_cores() -> None:
    """Under ``pytest -n N`` each worker, and every process it starts, computes on its own
    share of the cores, so two workers' thread pools do not take turns on the same ones."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2:
        return  # a serial run: as the process found it
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= count:
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) :: count])


_own_cores()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (pytest-xdist) the GPU tests run one after
    another in one process: several of them read the device's free memory."""
    for item in items:
        if GPU_TESTS in Path(item.fspath).parents:
            item.add_marker(pytest.mark.xdist_group("gpu"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster on loopback for the whole session (4 logical CPUs, so fractional-CPU
    placement groups fit on a 2-core machine); shut down at the end."""
    import ray

    from tandem.cluster.ray_cluster import init_ray

    started = not ray.is_initialized()
    init_ray(num_cpus=4)
    yield
    if started:
        ray.shutdown()
