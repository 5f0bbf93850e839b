"""Starting or joining the Ray cluster.

``init_ray(address=None, num_cpus=None)`` joins ``address`` (or ``$RAY_ADDRESS``) when given,
else starts a local single-node cluster (asking for loopback) with no dashboard. Calling it again
once Ray is up does nothing. ``node_ip(node_id)`` is a node's address, ``alive_nodes()`` the ids
of the alive nodes.

Ray 2.60 turns ``_node_ip_address="127.0.0.1"`` into the host's outward address
(``services.resolve_ip_for_localhost``), so the Ray node itself is not on loopback; what tandem
starts on a single node (the torch.distributed rendezvous, vLLM) is bound to 127.0.0.1.
"""

from __future__ import annotations

import os

import ray

LOOPBACK = "127.0.0.1"


def init_ray(address: str | None = None, num_cpus: float | None = None) -> None:
    """Join ``address``/``$RAY_ADDRESS`` or start a local loopback cluster; idempotent.

    ``num_cpus`` sizes a local cluster (logical CPUs may exceed the physical ones, which lets
    small machines host several fractional-CPU actors); it is ignored when joining."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    cpus = None if num_cpus is None else max(1, round(num_cpus))
    ray.init(
        address="local",  # not $RAY_ADDRESS, which was consulted above
        num_cpus=cpus,
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
    )


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == LOOPBACK for address in addresses):
            return name
    return "lo"


def node_ip(node_id: str) -> str:
    """The address a Ray node was started with (``ray.util.get_node_ip_address()`` would give
    the host's outward address, not the loopback one a local cluster binds to)."""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return str(node["NodeManagerAddress"])
    raise ValueError(f"no Ray node with id {node_id}")


def alive_nodes() -> list[str]:
    """Node ids of the alive Ray nodes."""
    return [node["NodeID"] for node in ray.nodes() if node["Alive"]]
