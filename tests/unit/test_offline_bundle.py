"""scripts/offline_bundle.sh: its arguments and the pip commands it would run (no download)."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_bundle.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_dry_run_defaults_to_cpython_312_manylinux_into_the_checkouts_gpu_folder() -> None:
    result = _run("--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        lines[0] == f"would write {SCRIPT.parents[1] / '.gpu'} (whl/, ray.tar.xz, unpack.sh) with:"
    )
    wheels, ray = lines[1], lines[2]
    for command in (wheels, ray):
        assert "pip download" in command
        assert "--python-version 3.12" in command
        assert "--platform manylinux_2_17_x86_64" in command
        assert "--only-binary=:all: --no-deps" in command
    assert f"-d {SCRIPT.parents[1] / '.gpu' / 'whl'}" in wheels
    for package in ("pydantic==2.14.4", "peft==", "accelerate", "datasets==", "trl=="):
        assert package in wheels
    assert ray.endswith("ray==2.60.0 ")


def test_dry_run_takes_the_target_and_folder_it_is_given(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    result = _run(
        "--dry-run",
        "--out",
        str(out),
        "--python-version",
        "3.11",
        "--platform",
        "manylinux_2_28_x86_64",
        "--ray-version",
        "2.59.0",
    )
    assert result.returncode == 0, result.stderr
    wheels, ray = result.stdout.splitlines()[1:3]
    assert f"-d {out / 'whl'}" in wheels
    assert "--python-version 3.11" in wheels and "--python-version 3.12" not in wheels
    assert "--platform manylinux_2_28_x86_64" in ray
    assert "manylinux2014_x86_64" not in ray
    assert ray.endswith("ray==2.59.0 ")
    assert not out.exists()


def test_a_wrong_argument_ends_with_exit_2_and_one_line() -> None:
    for args, words in (
        (("--bogus",), "unknown argument '--bogus'"),
        (("--python-version", "twelve"), "--python-version takes MAJOR.MINOR"),
        (("--out",), "--out needs a value"),
    ):
        result = _run(*args)
        assert result.returncode == 2
        assert result.stdout == ""
        assert words in result.stderr and len(result.stderr.splitlines()) == 1
