"""The terminal of a run: tandem's own lines only.

Everything else a run's processes print (warnings of vLLM, torch, Triton and transformers,
their C++ libraries' notes, what Ray forwards from the actors) goes to the run's log file,
``logs/console.log``, unless ``logging.verbose``. ``quiet_console`` does it at the level of the
file descriptors, so output from C/C++ code is caught too: for the duration of the run, fd 1 and
fd 2 point at the log file (and so do ``sys.stdout`` and ``sys.stderr``, whatever they were),
and tandem's own lines (the step lines, progress, its warnings) go to ``terminal()``, a copy of
the terminal's stderr taken before.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

_terminal: TextIO | None = None


def terminal() -> TextIO:
    """Where tandem's own lines go: the terminal while a run's console is quiet, else stderr."""
    return _terminal if _terminal is not None else sys.stderr


@contextmanager
def quiet_console(log_file: Path, verbose: bool = False) -> Iterator[TextIO]:
    """Within the block, fd 1 and 2 write to ``log_file`` (appended) and ``terminal()`` to the
    terminal; ``tandem.*`` loggers print to the terminal and the log. ``verbose``: change
    nothing. Yields the terminal's stream."""
    global _terminal
    if verbose or _terminal is not None:
        yield terminal()
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    stream = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    log = log_file.open("a", buffering=1, encoding="utf-8")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    tandem_logger = logging.getLogger("tandem")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    python_streams = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = log
    _terminal = stream
    tandem_logger.addHandler(handler)
    try:
        yield stream
    finally:
        tandem_logger.removeHandler(handler)
        log.flush()
        sys.stdout, sys.stderr = python_streams
        _repoint_handlers(log, python_streams[1])
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _terminal = None
        stream.close()
        log.close()


def _repoint_handlers(old: TextIO, new: TextIO) -> None:
    """Logging handlers made during the run with its ``sys.stderr`` (torch's with TORCH_LOGS,
    set up when torch is first imported) write to ``new`` from here: ``old``, the log file, is
    closed after the run, and they still log at exit (torch's compile summary)."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger(), *manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):  # placeholders have none
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.setStream(new)
