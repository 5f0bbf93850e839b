"""TCPStores that listen on one address only.

torch's ``TCPStore`` server binds every interface whatever host it is given; a store of tandem's
(the trainers' rendezvous, a refit's signals) listens on the address it is reached at instead:
127.0.0.1 on one node, the node's address on several. The socket is bound here and handed to
the store (``master_listen_fd``).
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PORT = 20000
"""Lowest port ``free_port`` picks: Ray's workers listen on 10002-19999 (its default range)."""


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now, for a rendezvous that binds it later.

    Taken outside the kernel's ephemeral range where it can: a port from binding port 0 lies in
    that range, and any process's outgoing connection (Ray opens many while actors start) may
    take it before the rendezvous binds it (EADDRINUSE, seen in the test suite). Outside it only
    an explicit bind can collide."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        ephemeral_low = FIRST_PORT
    candidates = range(FIRST_PORT, ephemeral_low)
    # SystemRandom: independent of the seeded global generator, so two seeded runs differ
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve(host: str, port: int, world_size: int | None, timeout_s: float) -> dist.TCPStore:
    """The server of a store on ``host:port`` (port 0: a free one; ``store.port`` says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns the socket from here
    )


def connect(host: str, port: int, world_size: int | None, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``host:port``."""
    return dist.TCPStore(
        host, port, world_size, False, timedelta(seconds=timeout_s), wait_for_workers=False
    )
