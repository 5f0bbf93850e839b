"""The environment builder with the real uv, on a tiny uv project (one small package, a wheel
the test writes itself, taken from a local folder offline) so builds take a second instead of
minutes and need no network or warm uv cache."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tandem.cluster import envs
from tandem.cluster.envs import EnvBuilder, EnvBuildError, EnvSpec

PROBE = "tandem-probe==1.0"
"""The tiny project's one dependency: a pure-Python wheel written by ``_write_probe_wheel``."""


def _write_probe_wheel(folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    files = {
        "tandem_probe/__init__.py": "VALUE = 1\n",
        "tandem_probe-1.0.dist-info/METADATA": (
            "Metadata-Version: 2.1\nName: tandem-probe\nVersion: 1.0\n"
        ),
        "tandem_probe-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: tandem-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append("tandem_probe-1.0.dist-info/RECORD,,")
    files["tandem_probe-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(folder / "tandem_probe-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def _write_project(root: Path, extra_b: list[str]) -> None:
    root.mkdir(exist_ok=True)
    _write_probe_wheel(root / "wheels")
    (root / "pyproject.toml").write_text(
        "[project]\n"
        'name = "tiny"\nversion = "0"\nrequires-python = ">=3.11"\ndependencies = []\n'
        "[project.optional-dependencies]\n"
        f"a = {json.dumps([PROBE])}\nb = {json.dumps(extra_b)}\n"
        '[tool.uv]\npackage = false\nno-index = true\nfind-links = ["wheels"]\n'
    )
    subprocess.run([*envs.uv_command(), "lock", "--offline", "-q"], cwd=root, check=True)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv(envs.ENV_DIR_VAR, str(tmp_path / "envs"))
    monkeypatch.delenv(envs.ENV_MODE_VAR, raising=False)
    _write_project(tmp_path / "proj", extra_b=[])
    return tmp_path / "proj"


def _builder(project: Path) -> EnvBuilder:
    return EnvBuilder(project_root=project, root=envs.cache_root())


def test_key_follows_requirements_only(project: Path) -> None:
    a, b = EnvSpec("a", ("a",)), EnvSpec("b", ("b",))
    before = _builder(project)
    key_a, key_b = before.key(a), before.key(b)
    assert key_a != key_b
    assert _builder(project).key(a) == key_a  # deterministic across builders
    assert before.key(EnvSpec("other", ("a",))) != key_a  # the spec is part of the key

    _write_project(project, extra_b=[PROBE])  # a dependency change in extra b only
    after = _builder(project)
    assert after.key(a) == key_a
    assert after.key(b) != key_b
    assert after.requirements(b) == [PROBE]
    exports = sorted((envs.cache_root() / envs.EXPORTS_DIR).iterdir())
    assert len(exports) == 4  # one per (lock, project file, extras): a's reused after the change
    assert _builder(project).requirements(b) == [PROBE]  # from the cache


def test_build_then_reuse(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = EnvSpec("a", ("a",))
    first = _builder(project).ensure(spec)
    assert first.built and first.complete
    assert first.path.name == f"a-{first.key[:12]}"
    out = subprocess.run(
        [str(first.python), "-c", "import tandem_probe, sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()) == first.path  # relocated venv knows its new home
    # compiled at build: with PYTHONDONTWRITEBYTECODE set, an actor would compile every import
    assert list(first.path.glob("lib/python*/site-packages/tandem_probe/__pycache__/*.pyc"))
    marker_mtime = (first.path / envs.MARKER).stat().st_mtime_ns

    walked: list[Path] = []
    real_size = envs._dir_size
    monkeypatch.setattr(envs, "_dir_size", lambda path: walked.append(path) or real_size(path))
    second = _builder(project).ensure(spec)
    assert walked == []  # reusing an environment does not walk its files (seconds for vLLM's)
    assert second.size_bytes > 0 and walked == [first.path]  # a listing still sizes it
    assert not second.built and second.path == first.path
    assert (first.path / envs.MARKER).stat().st_mtime_ns == marker_mtime
    assert [(i.name, i.complete) for i in envs.list_envs()] == [("a", True)]

    assert envs.clean_envs() == [first.path]
    assert envs.list_envs() == []


def test_bogus_extra_fails_and_leaves_nothing(project: Path) -> None:
    with pytest.raises(ValueError, match="bogus"):
        _builder(project).ensure(EnvSpec("a", ("bogus",)))
    assert not any(info.complete for info in envs.list_envs())


def test_failed_sync_leaves_nothing(project: Path, tmp_path: Path, monkeypatch) -> None:
    builder = _builder(project)
    builder.key(EnvSpec("a", ("a",)))  # exported now; the install then finds no wheel
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "empty-cache"))
    for wheel in (project / "wheels").iterdir():
        wheel.unlink()
    with pytest.raises(EnvBuildError, match="uv sync"):
        builder.ensure(EnvSpec("a", ("a",)))
    leftovers = [p.name for p in envs.cache_root().iterdir() if p.is_dir()]
    assert leftovers == [envs.EXPORTS_DIR]  # no env and no temporary build directory left behind
    assert envs.list_envs() == []


def test_interrupted_env_is_rebuilt(project: Path) -> None:
    spec = EnvSpec("a", ("a",))
    builder = _builder(project)
    path = builder.path(spec)
    (path / "bin").mkdir(parents=True)  # what a killed build would leave: files, no marker
    (path / "bin" / "python").symlink_to(sys.executable)
    assert not builder.info(spec).complete
    assert [i.complete for i in envs.list_envs()] == [False]

    info = builder.ensure(spec)
    assert info.built and info.complete and info.path == path


def test_concurrent_builds_make_one_env(project: Path) -> None:
    go = project / "go"
    code = (
        "import json, sys, time; from pathlib import Path; from tandem.cluster.envs import *\n"
        "builder = EnvBuilder(Path(sys.argv[1]))\n"
        "while not Path(sys.argv[2]).exists(): time.sleep(0.01)\n"  # start both at once
        "info = builder.ensure(EnvSpec('a', ('a',)))\n"
        "print(json.dumps({'path': str(info.path), 'built': info.built}))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(project), str(go)], stdout=subprocess.PIPE
        )
        for _ in range(2)
    ]
    go.touch()
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert results[0]["path"] == results[1]["path"]
    assert sorted(r["built"] for r in results) == [False, True]
    dirs = [p.name for p in envs.cache_root().iterdir() if p.is_dir()]
    assert sorted(dirs) == [envs.EXPORTS_DIR, Path(results[0]["path"]).name]


def test_wheels_link_follows_pip_config(project: Path, tmp_path: Path, monkeypatch) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    link = envs.ensure_wheels_link(project)
    assert link == project / ".wheels" and link.resolve() == wheels.resolve()


def test_registry_and_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv(envs.ENV_MODE_VAR, raising=False)
    assert envs.spec_for("driver").extras == ()
    assert envs.spec_for("trainer").extras == ("train",)
    # the trainers' kind by backend and optimizer: only theirs installs megatron-core or torchao
    assert envs.trainer_kind("fsdp2") == "trainer"
    assert envs.trainer_kind("megatron") == "trainer_megatron"
    assert envs.trainer_kind("fsdp2", stochastic_round=True) == "trainer_lowbit"
    assert envs.spec_for("trainer_lowbit").extras == ("train", "lowbit")
    assert envs.spec_for("trainer_megatron").extras == ("train", "megatron")
    gpu = torch.cuda.is_available()
    assert envs.spec_for("generator").extras == (("vllm",) if gpu else ("vllm-cpu",))
    with pytest.raises(ValueError, match="registered kinds"):
        envs.spec_for("critic")
    with pytest.raises(ValueError, match="letters"):
        EnvSpec("bad.name")

    assert envs.env_mode() == "isolated"
    shared = envs.runtime_env_for("trainer", mode="shared", env_vars={"X": "1"})
    assert shared["py_executable"] == sys.executable
    assert shared["env_vars"]["X"] == "1"
    monkeypatch.setenv(envs.ENV_MODE_VAR, "shared")
    assert envs.runtime_env_for("generator", mode="isolated")["py_executable"] == sys.executable
    monkeypatch.setenv(envs.ENV_MODE_VAR, "sideways")
    with pytest.raises(ValueError, match="isolated"):
        envs.env_mode()


def test_driver_environment_is_compiled() -> None:
    """``./run.sh`` syncs the project's environment with compiled bytecode: where
    PYTHONDONTWRITEBYTECODE is set, a source-only install compiles ray, torch and transformers in
    every process that imports them (3.6 s more for the driver's start alone)."""
    import importlib.util

    import ray
    import torch
    import transformers

    root = envs.find_project_root()
    if Path(sys.prefix).resolve() != (root / ".venv").resolve():
        pytest.skip("not running in the environment ./run.sh sets up")
    for module in (ray, torch, transformers):
        source = Path(module.__file__)
        assert Path(importlib.util.cache_from_source(str(source))).is_file(), source


def test_project_root_is_the_checkout() -> None:
    root = envs.find_project_root()
    assert (root / "uv.lock").is_file()
    assert Path(envs.__file__).resolve().is_relative_to(root)
    assert os.path.isdir(root / "src" / "tandem")


def test_management_functions(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI's entry points, on the tiny project and a one-kind registry.
    monkeypatch.setattr(envs, "find_project_root", lambda: project)
    monkeypatch.setattr(envs, "REGISTRY", {"tiny": EnvSpec("tiny", ("a",))})
    (first,) = envs.build_envs()
    assert first.built and first.complete and first.build_seconds is not None
    (again,) = envs.build_envs(["tiny"])
    assert not again.built and again.path == first.path
    marker = first.path / envs.MARKER
    before = json.loads(marker.read_text())
    (rebuilt,) = envs.build_envs(rebuild=True)
    assert rebuilt.built and rebuilt.path == first.path
    assert json.loads(marker.read_text())["build_seconds"] != before["build_seconds"]
    assert "complete" in str(rebuilt) and str(first.path) in str(rebuilt)
    assert envs.clean_envs(["tiny"]) == [first.path]
    assert envs.list_envs() == []
