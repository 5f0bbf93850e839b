"""Fixtures of the GPU tests."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A trainer under FSDP2 at world size 1 joins a one-rank NCCL group; it outlives the
    module's tests and is destroyed after them. Each module gets a fresh port: the last group's
    may linger."""
    if not torch.distributed.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
