"""The per-actor environments with real uv and real Ray: the trainer cannot import vLLM, the
generator can, each in its own interpreter. Builds both environments cold (a fresh cache root),
then again warm, and prints the timings as one JSON line (run with -s to see it)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from workers import TESTS_DIR, ProbeWorker

from tandem.cluster import envs
from tandem.cluster.worker_group import WorkerGroup

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]
KINDS = ["trainer", "generator"]


def _markers(builder: envs.EnvBuilder) -> dict[str, int]:
    return {k: (builder.path(envs.spec_for(k)) / envs.MARKER).stat().st_mtime_ns for k in KINDS}


def _build_twice(record_property) -> dict[str, str]:
    """Cold then warm build on every node; asserts the warm one reuses the cache."""
    start = time.perf_counter()
    cold = envs.build_on_all_nodes(KINDS)
    cold_s = time.perf_counter() - start
    builder = envs.EnvBuilder()
    infos = {kind: builder.info(envs.spec_for(kind)) for kind in KINDS}
    assert all(info.complete for info in infos.values())
    markers = _markers(builder)

    start = time.perf_counter()
    warm = envs.build_on_all_nodes(KINDS)
    warm_s = time.perf_counter() - start
    assert warm == cold  # same interpreters on every node
    assert _markers(builder) == markers  # nothing rebuilt
    assert warm_s < 20 and warm_s < cold_s / 3

    figures = {
        "figure": "env_build_seconds",
        "cold_s": round(cold_s, 1),
        "warm_s": round(warm_s, 2),
        **{f"{k}_build_s": round(infos[k].build_seconds or 0.0, 1) for k in KINDS},
        **{f"{k}_size_gb": round(infos[k].size_bytes / 2**30, 2) for k in KINDS},
    }
    print(json.dumps(figures))
    for name, value in figures.items():
        record_property(name, value)
    (node_pythons,) = warm.values()  # a single-node test cluster
    return node_pythons


def test_trainer_cannot_import_vllm_generator_can(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property
) -> None:
    monkeypatch.setenv(envs.ENV_DIR_VAR, str(tmp_path / "envs"))
    monkeypatch.delenv(envs.ENV_MODE_VAR, raising=False)
    try:
        pythons = _build_twice(record_property)
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
        assert Path(trainer["prefix"]).parent == tmp_path / "envs"
    finally:
        envs.clean_envs()
