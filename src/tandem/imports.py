"""Imports: objects a user names in a config (a built-in name or an import path
``package.module:name``), and heavy imports without the cyclic garbage collector."""

from __future__ import annotations

import atexit
import gc
import importlib
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


def import_named(kind: str, spec: str, builtins: Iterable[str], example: str) -> object:
    """The object at ``spec`` (``package.module:name``); otherwise a ValueError naming ``kind``,
    ``spec``, the built-ins and what is wrong (no path, no module, no such name)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"{kind} {spec!r} is neither a built-in ({', '.join(builtins)}) nor an import path "
            f"'package.module:{example}'"
        )
    module = _import_module(kind, spec, module_name)
    found = getattr(module, attr, None)
    if found is None:
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return found


def import_error(module_name: str) -> str | None:
    """Why ``module_name`` does not import in this interpreter (its exception, first line), or
    None when it imports. A build that is installed but broken counts as not importable
    (torchvision's CUDA wheel beside torch+cpu raises RuntimeError at import)."""
    try:
        importlib.import_module(module_name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _import_module(kind: str, spec: str, module_name: str) -> object:
    """The module of a user's ``spec``; whatever stops its import (not found, a dependency it
    lacks, a syntax error, an exception in its body) is a ValueError saying which."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and f"{module_name}.".startswith(f"{exc.name}."):
            raise ValueError(
                f"{kind} {spec!r}: cannot import module {module_name!r} ({exc}); check the path "
                "and that the module is installed or on PYTHONPATH"
            ) from None
        raise ValueError(
            f"{kind} {spec!r}: module {module_name!r} imports {exc.name!r}, which is not "
            f"installed ({exc})"
        ) from None
    except SyntaxError as exc:
        raise ValueError(
            f"{kind} {spec!r}: module {module_name!r} has a syntax error: {exc.filename}, line "
            f"{exc.lineno}: {exc.msg}"
        ) from None
    except Exception as exc:  # the module's own code raised while it was imported
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ValueError(
            f"{kind} {spec!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc} ({where.filename}, line {where.lineno})"
        ) from None


_paused = False
"""Whether ``pause_gc`` turned the collector off (and ``resume_gc`` has not yet)."""

_unfreeze_at_exit = False
"""Whether ``_freeze`` has registered ``gc.unfreeze`` to run at exit."""


def _freeze() -> None:
    """``gc.freeze()``, and ``gc.unfreeze()`` when the process exits. The interpreter's last
    collection skips frozen objects, so cycles frozen with the start heap outlive it: triton's
    (imported by ``torch._dynamo``, which transformers imports) then made nanobind print about
    sixty "leaked instance/type/function" lines at the end of every command and test run.
    Unfrozen, they are collected, at the price of a slower exit (figures:
    docs/benchmarks/2026-12-05-cpu-e2e-intel.md)."""
    global _unfreeze_at_exit
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True


def pause_gc() -> None:
    """Turn the cyclic garbage collector off while a process starts (its heavy imports, Ray,
    the actors); ``resume_gc`` ends the pause. See ``without_gc`` for why."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_gc() -> None:
    """End ``pause_gc``: freeze everything alive (collections skip it from now on) and turn the
    collector back on. Nothing happens unless ``pause_gc`` turned it off."""
    global _paused
    if _paused:
        _freeze()
        gc.enable()
        _paused = False


@contextmanager
def without_gc() -> Iterator[None]:
    """Run heavy imports with the cyclic collector off, then freeze what they allocated.

    Importing torch, transformers and vLLM allocates about 700,000 objects that live as long as
    the process. With the collector on, its full passes walk that growing heap again and again
    (a fifth of vLLM's import on a 2-core machine), and every later ``gc.collect()`` walks it
    once more (vLLM calls it five times while its engine starts; figures:
    docs/benchmarks/2026-12-04-cpu-e2e.md).
    ``gc.freeze()`` moves everything alive at the end into the permanent generation, which
    collections skip; objects made afterwards are collected as usual. The collector is left as
    it was found (on, unless the caller had turned it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _freeze()
        if enabled:
            gc.enable()
