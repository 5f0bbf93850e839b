"""Folders written so that a crash leaves the old one or the new one, never half of one.

Every "write to a temporary name, then rename" in tandem goes through ``atomic_dir``: run
checkpoints (``runs.Checkpoints``), trainer checkpoints (``checkpoint.sharded``), Hugging Face
exports (``checkpoint.hf_export``) and actor environments (``cluster.envs``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def sibling(path: Path, suffix: str, hidden: bool = False) -> Path:
    """``<path><suffix>`` beside ``path`` (``.<name><suffix>`` when ``hidden``)."""
    return path.with_name(("." if hidden else "") + path.name + suffix)


def remove_dir(path: Path) -> None:
    """``shutil.rmtree`` that finishes when a Ctrl-C or SIGTERM cuts it (the interrupt handler
    ignores the signals after the first), then lets the interrupt go on: a removal is short,
    and one left half-done leaves a hidden folder behind an interrupted run."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def replace_dir(tmp: Path, path: Path, hidden: bool = False) -> None:
    """Rename the complete folder ``tmp`` to ``path``. ``rename`` cannot replace a folder that
    holds files, so a previous ``path`` is renamed to its ``.old`` sibling first and removed
    after: at every instant a complete folder is at ``path`` or at ``.old`` (a reader that
    finds neither at ``path`` looks there, as ``checkpoint.sharded.complete`` does)."""
    old = sibling(path, ".old", hidden)
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    remove_dir(old)


@contextlib.contextmanager
def atomic_dir(path: Path, *, hidden: bool = False, create: bool = True) -> Iterator[Path]:
    """A fresh temporary sibling of ``path`` (``<path>.tmp``) to fill. When the block ends, it
    replaces ``path`` (``replace_dir``); when the block raises, it is removed. A process that
    dies inside the block leaves it behind, and the next ``atomic_dir(path)`` removes it first.

    ``hidden``: the temporary and old names start with a dot, so listings that skip dot-names
    never see them. ``create=False``: the block creates the folder itself (for a tool that
    insists on making it); its parent exists."""
    tmp = sibling(path, ".tmp", hidden)
    shutil.rmtree(tmp, ignore_errors=True)
    if create:
        tmp.mkdir(parents=True)
    else:
        tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        replace_dir(tmp, path, hidden)
    except BaseException:
        remove_dir(tmp)
        raise
