"""Shared fixtures; the GPU tests in one worker of a parallel run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).parent / "gpu"


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
