"""The store a refit signals through: a standalone TCPStore served by the sender (never the
trainer's default group), its clients, and waiting on signals with a timeout and abort.

A signal is a key set to a value; ``abort:<message>`` in place of the value ends the refit on
the side that waits for it, with that message.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from tandem import rendezvous

ABORT = b"abort:"
"""Prefix of a signal value that ends the refit on the other side with the message after it."""


class RefitError(RuntimeError):
    """A refit failed on the other side or timed out (e.g. a generator worker died)."""


_CLIENT_STORES: dict[tuple[str, int], tuple[str, dist.TCPStore]] = {}


def connect_store(host: str, port: int, store_id: str, timeout_s: float) -> dist.TCPStore:
    """A client of the sender's store, cached per process (one-time setup across refits).

    ``store_id`` names the server: a sender that took the port of one gone before it (a
    restarted trainer; the kernel reuses ports) gets a new client, never the cached client of
    the closed server (whose first request fails with a broken pipe)."""
    cached = _CLIENT_STORES.get((host, port))
    if cached is None or cached[0] != store_id:
        client = dist.TCPStore(
            host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False
        )
        cached = _CLIENT_STORES[(host, port)] = (store_id, client)
    return cached[1]


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A standalone store on a free port of ``host`` only (not the trainer's default group)."""
    return rendezvous.serve(host, 0, None, timeout_s)


def wait_signals(store: dist.Store, keys: list[str], timeout_s: float, what: str) -> list[bytes]:
    """Wait for ``keys`` and return their values (one round trip: ``multi_get`` waits up to the
    store's timeout, ``timeout_s``); raise RefitError naming ``what`` on timeout, an abort or
    a store that went away."""
    try:
        values = store.multi_get(keys)
    except dist.DistStoreError as error:
        raise RefitError(
            f"refit timed out after {timeout_s:.0f} s waiting for {what}; a generator worker or "
            f"the trainer probably died or stopped consuming (keys {keys[:4]})"
        ) from error
    except dist.DistNetworkError as error:
        raise RefitError(
            f"refit lost the sender's store while waiting for {what}; the trainer that served "
            f"it probably died ({error})"
        ) from error
    for value in values:
        if value.startswith(ABORT):
            raise RefitError(f"refit aborted by the other side: {value[len(ABORT) :].decode()}")
    return values


def abort_signal(message: str) -> str:
    return ABORT.decode() + message[:2000]


def set_signals(store: dist.Store, keys: list[str], values: str | list[str]) -> None:
    """Set ``keys`` to ``values`` (one value for every key, or one each) in one round trip."""
    if isinstance(values, str):
        values = [values] * len(keys)
    store.multi_set(keys, values)  # type: ignore[attr-defined]  # (not in torch's stubs)
