"""The ``tandem`` command's way out (``cli.entry``): it skips the interpreter's teardown, not the
exit handlers, the exit status or the output still buffered for a pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tandem

SCRIPT = """
import atexit, sys
atexit.register(lambda: open({mark!r}, "w").write("ran"))
sys.argv = ["tandem", *{args!r}]
from tandem.cli import entry
entry()
raise SystemExit("entry() returned")
"""


@pytest.mark.parametrize(
    ("args", "status", "expected"),
    [
        (["version"], 0, tandem.__version__),
        (["grpo", "algorithm.num_stepz=2"], 2, "num_stepz"),
    ],
)
def test_the_command_runs_its_exit_handlers_and_keeps_its_status(
    tmp_path: Path, args: list[str], status: int, expected: str
) -> None:
    mark = tmp_path / "handler"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(mark=str(mark), args=args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status, done.stderr[-2000:]
    assert expected in done.stdout + done.stderr  # flushed although stdout is a pipe
    assert mark.read_text() == "ran"
