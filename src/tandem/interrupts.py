"""Ctrl-C and SIGTERM end a command quietly and soon, at any moment of it.

Both become an exception in the main thread (``KeyboardInterrupt``; ``Terminated``, a subclass,
for SIGTERM), so every ``with`` block on the way out runs: reward workers are stopped, a
checkpoint being written is removed (``files.atomic_dir``), the console is restored. From the
signal on, errors that objects' finalisers and worker threads raise while they are torn down
are not printed (a generator engine's ``__del__`` that finds its process half-stopped would
print a traceback after the "interrupted" line). If the way out takes longer than ``GRACE_S``,
a watchdog kills the command's child processes and exits with the same status.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

GRACE_S = 4.0
"""How long the way out of an interrupted command may take before it is cut short (the
promise is an exit within 5 s of the signal)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's ``KeyboardInterrupt`` would be."""


_received: KeyboardInterrupt | None = None
"""The interrupt the running ``signals_as_interrupts`` block raised, if any."""


def received() -> KeyboardInterrupt | None:
    """The interrupt raised in the running ``signals_as_interrupts`` block, None without a
    signal. An exception that reaches the command in its place is the interrupt in a library's
    words (torch's checkpoint writer turns ``KeyboardInterrupt`` into ``CheckpointException``)."""
    return _received


def exit_status(interrupt: KeyboardInterrupt) -> tuple[int, str]:
    """The exit status and the word for an interrupt: 143 terminated, 130 interrupted."""
    if isinstance(interrupt, Terminated):
        return 128 + signal.SIGTERM, "terminated"
    return 128 + signal.SIGINT, "interrupted"


def _quiet(*_: Any) -> None:
    """An unraisable error (a finaliser's) or a thread's, while the command is torn down."""


def _watchdog(done: threading.Event, status: int, label: str, word: str) -> None:
    if done.wait(GRACE_S):
        return
    from tandem.logging.console import terminal  # the terminal, also while a run's is quiet

    stream = terminal()
    print(f"{label}: {word} (stopping took over {GRACE_S:g} s: cut short)", file=stream)
    stream.flush()
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(status)


@contextmanager
def signals_as_interrupts(label: str = "tandem") -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``Terminated`` in the
    main thread; the first of them also silences finalisers and starts the watchdog (which
    prints ``label: interrupted`` when it cuts the way out short); later ones are ignored, so
    a second Ctrl-C does not stop the cleanup half-way. Outside the main thread
    (where handlers cannot be set) the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _received
    _received = None
    done = threading.Event()
    hooks = sys.unraisablehook, threading.excepthook
    signalled = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        global _received
        nonlocal signalled
        if signalled:  # a second Ctrl-C would cut the cleanup half-way; the watchdog bounds it
            return
        signalled = True
        interrupt = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        _received = interrupt
        sys.unraisablehook = _quiet
        threading.excepthook = _quiet
        status, word = exit_status(interrupt)
        watchdog = threading.Thread(target=_watchdog, args=(done, status, label, word), daemon=True)
        watchdog.start()
        raise interrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        done.set()
        _received = None
        for sig, old in previous.items():
            signal.signal(sig, old)
        if not signalled:  # else the process is ending: its last finalisers stay quiet too
            sys.unraisablehook, threading.excepthook = hooks
