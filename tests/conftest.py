"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
