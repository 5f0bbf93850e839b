"""tandem's TCPStores listen on the address they are reached at, not on every interface."""

from __future__ import annotations

import psutil

from tandem import rendezvous
from tandem.weight_sync.signals import serve_store


def _listening(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_a_served_store_listens_on_its_host_only_and_serves_clients() -> None:
    store = rendezvous.serve("127.0.0.1", 0, None, timeout_s=10)
    assert _listening(store.port) == {"127.0.0.1"}
    client = rendezvous.connect("127.0.0.1", store.port, None, timeout_s=10)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_the_refit_store_listens_on_loopback() -> None:
    store = serve_store("127.0.0.1", timeout_s=10)
    assert _listening(store.port) == {"127.0.0.1"}
