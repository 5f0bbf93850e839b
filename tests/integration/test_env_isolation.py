"""The per-actor environments with real uv and real Ray: the trainer cannot import vLLM, the
generator can, each in its own interpreter, from the environments a run would use (the cache
root; built here if missing, else reused, as ``test_two_checkouts`` does). Asking again builds
nothing. What a cold build costs is a benchmark: ``bench/env_build.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from workers import TESTS_DIR, ProbeWorker

from tandem.cluster import envs
from tandem.cluster.worker_group import WorkerGroup

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]
KINDS = ["trainer", "generator"]


def _markers(builder: envs.EnvBuilder) -> dict[str, int]:
    return {k: (builder.path(envs.spec_for(k)) / envs.MARKER).stat().st_mtime_ns for k in KINDS}


def test_trainer_cannot_import_vllm_generator_can(
    ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(envs.ENV_MODE_VAR, raising=False)
    first = envs.build_on_all_nodes(KINDS)
    builder = envs.EnvBuilder()
    assert all(builder.info(envs.spec_for(kind)).complete for kind in KINDS)
    markers = _markers(builder)
    assert envs.build_on_all_nodes(KINDS) == first  # same interpreters on every node
    assert _markers(builder) == markers  # nothing rebuilt
    (pythons,) = first.values()  # a single-node test cluster

    env_vars = {"PYTHONPATH": TESTS_DIR}
    groups = {
        kind: WorkerGroup(ProbeWorker, 1, kind, env_vars=env_vars, env_mode="isolated")
        for kind in KINDS
    }
    try:
        trainer = groups["trainer"].run_rank0("probe", "vllm")
        generator = groups["generator"].run_rank0("probe", "vllm")
        assert trainer["import_error"] is not None and "vllm" in trainer["import_error"]
        assert generator["import_error"] is None
        assert groups["trainer"].run_rank0("probe", "transformers")["import_error"] is None
    finally:
        for group in groups.values():
            group.shutdown()
    assert trainer["executable"] == pythons["trainer"]
    assert generator["executable"] == pythons["generator"]
    assert len({trainer["executable"], generator["executable"], sys.executable}) == 3
    assert Path(trainer["prefix"]).parent == envs.cache_root()
