"""tandem's TCPStores listen on the address they are reached at, not on every interface."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

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


def test_a_free_port_lies_outside_the_ephemeral_range_and_binds() -> None:
    """Ports from binding port 0 come from the ephemeral range, where any outgoing connection
    may take one before the rendezvous binds it; free_port stays below it."""
    low = int(rendezvous.EPHEMERAL_RANGE.read_text().split()[0])
    ports = {rendezvous.free_port("127.0.0.1") for _ in range(20)}
    assert all(rendezvous.FIRST_PORT <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn at random: two runs on one machine do not race for one port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_a_free_port_without_room_below_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "range").write_text("1024\t60999\n")
    monkeypatch.setattr(rendezvous, "EPHEMERAL_RANGE", tmp_path / "range")
    port = rendezvous.free_port("127.0.0.1")  # no candidates: the kernel's pick
    assert port > 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
