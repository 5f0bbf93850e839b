"""A run's terminal shows tandem's lines; what libraries print, from Python or from C, goes to
the run's log (``logging/console.py``)."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import warnings
from pathlib import Path

import pytest

from tandem.logging.console import quiet_console, terminal


def _noise() -> None:
    print("python print to stdout")
    print("python print to stderr", file=sys.stderr)
    warnings.warn("a library's FutureWarning", FutureWarning, stacklevel=1)
    logging.getLogger("vllm.engine").warning("a library's logger")
    os.write(2, b"a C library writing fd 2\n")
    libc = ctypes.CDLL(None)
    libc.puts(b"a C library writing stdout")
    libc.fflush(None)


def test_quiet_console_sends_library_output_to_the_log_and_keeps_tandems_lines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "logs" / "console.log"
    with quiet_console(log) as stream:
        assert terminal() is stream
        _noise()
        print("step    1  loss 0.5", file=terminal())
        logging.getLogger("tandem.algorithms.grpo").warning("logprob mismatch alarm")
    assert terminal() is sys.stderr  # restored
    print("after the run", file=sys.stderr)
    out, err = capfd.readouterr()
    shown = out + err
    assert "step    1  loss 0.5" in shown and "logprob mismatch alarm" in shown
    assert "after the run" in shown
    for noise in ("python print", "FutureWarning", "a library's logger", "a C library"):
        assert noise not in shown, noise
    written = log.read_text()
    # (pytest takes the warnings and the log records itself; a real run's reach the log, as
    # test_cli_output checks)
    for noise in ("python print to stdout", "python print to stderr"):
        assert noise in written, noise
    assert "a C library writing fd 2" in written and "a C library writing stdout" in written


def test_verbose_leaves_the_terminal_as_it_is(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "console.log"
    with quiet_console(log, verbose=True):
        os.write(2, b"a C library writing fd 2\n")
    assert "a C library writing fd 2" in capfd.readouterr().err
    assert not log.exists()


def test_an_error_inside_restores_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(KeyboardInterrupt), quiet_console(tmp_path / "console.log"):
        raise KeyboardInterrupt
    os.write(2, b"interrupted\n")
    assert "interrupted" in capfd.readouterr().err


def test_a_handler_made_during_the_run_logs_after_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A library that sets up its logging inside the run (torch with TORCH_LOGS, on its first
    import) binds its handler to the run's stderr, the log file; logging at exit (torch's
    compile summary) wrote "--- Logging error ---" on the closed file."""
    logger = logging.getLogger("a_library_of_the_run")
    logger.propagate = False
    with quiet_console(tmp_path / "console.log"):
        handler = logging.StreamHandler(sys.stderr)
        logger.addHandler(handler)
        logger.warning("inside the run")
    try:
        logger.warning("at exit")
    finally:
        logger.removeHandler(handler)
    err = capfd.readouterr().err
    assert "at exit" in err and "Logging error" not in err
    assert "inside the run" in (tmp_path / "console.log").read_text()
