"""TCPStores that listen on one address only.

torch's ``TCPStore`` server binds every interface whatever host it is given; a store of tandem's
(the trainers' rendezvous, a refit's signals) listens on the address it is reached at instead:
127.0.0.1 on one node, the node's address on several. The socket is bound here and handed to
the store (``master_listen_fd``).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


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
