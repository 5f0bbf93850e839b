"""The collector is off while a process starts and on, over a frozen start heap, afterwards."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.cli import main
from tandem.imports import pause_gc, resume_gc, without_gc


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    gc.enable()
    yield
    resume_gc()
    gc.enable()


def test_without_gc_freezes_what_it_allocated() -> None:
    before = gc.get_freeze_count()
    with without_gc():
        assert not gc.isenabled()
        made = [[index] for index in range(1000)]  # containers the collector tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)


def test_without_gc_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    with without_gc():
        pass
    assert not gc.isenabled()
    resume_gc()  # it did not pause the collector: nothing to resume
    assert not gc.isenabled()


def test_resume_ends_only_a_pause() -> None:
    pause_gc()
    assert not gc.isenabled()
    before = gc.get_freeze_count()
    made = [[index] for index in range(1000)]
    resume_gc()
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    assert frozen >= before + len(made)
    more = [[index] for index in range(1000)]
    resume_gc()  # a second resume freezes nothing
    assert gc.get_freeze_count() == frozen
    assert len(more) == 1000


def test_the_cli_starts_a_command_with_the_collector_off(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    def run_grpo(config: Any, resume: bool = False) -> list[dict[str, Any]]:
        seen.append(gc.isenabled())
        return []

    monkeypatch.setattr("tandem.driver.run_grpo", run_grpo)
    assert main(["grpo", "algorithm.num_steps=1"]) == 0
    assert seen == [False]
    assert gc.isenabled()  # back on however the command ended


def test_the_run_resumes_the_collector(tmp_path: Path) -> None:
    """The start (imports, workers) runs without the collector; the steps run with it: the
    run folder opens with it on again."""
    from tandem.config import GrpoConfig, load_config
    from tandem.driver import open_run

    overrides = [f"logging.run_dir={tmp_path}", "logging.tensorboard=false"]
    overrides += [
        "logging.progress=false",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",
    ]
    config = load_config(GrpoConfig, None, overrides)

    class Workers:  # what open_run asks of a runtime that is not resumed or exported
        where = "nowhere"

    pause_gc()
    with open_run(config, tmp_path / "run", False, Workers()) as run:  # type: ignore[arg-type]
        assert gc.isenabled()
        run.log(1, {"loss": 0.0})
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("loss") == 1


@pytest.mark.parametrize("how", ["pause", "without_gc"])
def test_cycles_frozen_at_the_start_are_collected_at_exit(how: str) -> None:
    """A frozen cycle outlives the interpreter's last collection unless it is unfrozen first
    (left alive, triton's objects made nanobind print "leaked" lines at every exit)."""
    script = f"""
import gc
from tandem.imports import pause_gc, resume_gc, without_gc

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        print("finalized", flush=True)

gc.enable()
if {how!r} == "pause":
    pause_gc()
    made = Cycle()
    resume_gc()
else:
    with without_gc():
        made = Cycle()
del made
gc.collect()  # skips the frozen cycle
print("end of script", flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["end", "of", "script", "finalized"]
