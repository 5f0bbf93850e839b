"""Colocated refit on the CPU: both bucket slots are one file in /dev/shm, mapped by the sender
and every receiver (``mmap``). The sender unlinks the file once every receiver has
mapped it, so nothing is left behind if a process dies after that; the memory goes with the last
mapping. A sender killed before its receivers attached (a generator died first, then Ray killed
the trainer) leaves its file: a later sender on the host removes the files of senders that no
longer run, once they are older than its refit timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import mmap
import os
import tempfile
import time
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from tandem.weight_sync.base import NUM_SLOTS, RefitSender, RefitSpec, SenderRefit, slot_layout
from tandem.weight_sync.colocated import ColocatedReceiver, ColocatedRefit, slots_of
from tandem.weight_sync.signals import RefitError


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


PREFIX = "tandem-refit-"


def remove_orphans(folder: str, older_than_s: float) -> list[str]:
    """Remove the refit files in ``folder`` whose sender process is gone and that are older
    than ``older_than_s`` (a refit's timeout: no receiver waits for them any more; a sender in
    another PID namespace sharing /dev/shm looks gone, but its file is younger while it lives).
    Returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(folder, f"{PREFIX}*-*")):
        pid = os.path.basename(path)[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            if time.time() - os.stat(path).st_mtime > older_than_s:
                os.unlink(path)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _map(path: str, nbytes: int) -> torch.Tensor:
    """The file's first ``nbytes``, mapped shared; FileNotFoundError if it is gone. Never creates
    it (``torch.from_file`` would: a receiver attaching as the sender aborts and unlinks would
    leave a new file behind)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping while it lives


class ShmSender(RefitSender):
    """Shares two bucket slots with the receivers of the same host through shared memory."""

    transport = "colocated"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        remove_orphans(_shm_dir(), older_than_s=self.timeout_s)

    def _open(self, spec: RefitSpec, live: list[torch.Tensor]) -> SenderRefit:
        return _ShmRefit(spec, self._store)


class _ShmRefit(ColocatedRefit):
    def __init__(self, spec: RefitSpec, store: dist.TCPStore) -> None:
        # Both slots in one file, each as large as the largest bucket: a tiny model does not
        # pin 2 x bucket_bytes.
        size, num_slots = slot_layout(spec.plan)
        path = os.path.join(_shm_dir(), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size * num_slots)
        os.close(fd)
        weakref.finalize(self, _unlink, path)  # if send() never runs (or the process ends)
        super().__init__(dataclasses.replace(spec, shm_path=path), store)
        self._path = path
        self._buffers = slots_of(_map(path, size * num_slots), size, num_slots)

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def _on_attached(self, values: list[bytes]) -> None:
        _unlink(self._path)  # every receiver has mapped it: nothing is left if anyone dies

    def close(self) -> None:
        self._buffers = []
        _unlink(self._path)


class ShmReceiver(ColocatedReceiver):
    """Maps the sender's shared-memory slots."""

    def __init__(self, spec: RefitSpec, device: torch.device, rank: int) -> None:
        super().__init__(spec, device, rank)
        self._buffers: list[torch.Tensor] = []

    def _attach(self) -> str:
        path = self.spec.shm_path
        size, num_slots = slot_layout(self.spec.plan)
        try:
            whole = _map(path, size * num_slots)
        except FileNotFoundError:
            aborted = self._abort_message()  # the sender failed before this receiver came
            raise RefitError(
                f"refit {self.spec.refit_id}: the trainer's buffers {path} are gone: the "
                "refit already ended (a stale spec) or the trainer died"
                + (f"; the trainer aborted it: {aborted}" if aborted else "")
            ) from None
        self._buffers = slots_of(whole, size, num_slots)
        return "1"

    def _slot(self, index: int) -> torch.Tensor:
        return self._buffers[index % NUM_SLOTS]

    def _detach(self) -> None:
        self._buffers = []
