"""Starting or joining the Ray cluster.

``init_ray(address=None, num_cpus=None)`` joins ``address`` (or ``$RAY_ADDRESS``) when given,
else starts a local single-node cluster (asking for loopback) with no dashboard, whose workers
run at the driver's priority (niceness 0, not Ray's 15). Calling it again
once Ray is up does nothing; ``shutdown_ray()`` stops it without Ray's idle seconds.
``node_ip(node_id)`` is a node's address, ``alive_nodes()`` the ids of the alive nodes,
``bind_to(address)`` points an actor's gloo, NCCL and vLLM at its node's address.

A local cluster listens on loopback only. Ray binds its gRPC servers (GCS, raylet, every
worker and the driver) to 127.0.0.1 when the node's address is 127.0.0.1 and to every interface
otherwise; its runtime-env agent and autoscaler metrics bind the node's address. But ``ray.init``
turns ``_node_ip_address="127.0.0.1"`` into the host's outward address
(``services.resolve_ip_for_localhost``) unless Ray's single-node switch is off: the one it keeps
off on Windows and macOS (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read into
``ray_constants.ENABLE_RAY_CLUSTER`` when ray is imported). ``init_ray`` turns it off while it
starts a local cluster (``_single_node_switch``). What tandem starts on one node (the
torch.distributed rendezvous, gloo, vLLM) is bound to 127.0.0.1 too. A joined cluster is the
one ``ray start`` made: its node addresses are the ones given there (``--node-ip-address``),
and tandem's listeners bind them; Ray's gRPC servers there listen on every interface (Ray has
no setting for one), guarded by Ray's token authentication.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray
from ray._private import ray_constants

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
    with _single_node_switch():
        ray.init(
            address="local",  # not $RAY_ADDRESS, which was consulted above
            num_cpus=cpus,
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            # Ray starts one idle worker per CPU in the driver's environment for the first
            # driver; our actors run in their own environments and never use them, and their
            # imports slow the actors' start (docs/benchmarks/2026-12-04-cpu-e2e.md).
            # Ray runs its workers at niceness 15 (``worker_niceness``): on a machine shared with
            # other work every actor then yields the cores to anything at the default 0; a
            # reward-model actor scored at 0.61x of the same forward in the driver under load
            # (docs/reward_models.md). Ray's nice() adds to its own: the actors keep the driver's.
            _system_config={"prestart_worker_first_driver": False, "worker_niceness": 0},
        )


def shutdown_ray() -> None:
    """``ray.shutdown()`` now, the autoscaler monitor of a cluster this process started first.

    Ray's shutdown stops the GCS before the monitor, whose SIGTERM handler then reports its end
    to the stopped GCS until Ray kills it a second later, on every run's exit, where a SIGKILL
    first costs nothing (the monitor keeps no state of a local cluster's). Called before the
    interpreter's exit, Ray's shutdown also skips the sleep it takes there for late log lines
    (figures: docs/benchmarks/2026-12-05-cpu-e2e-intel.md). A joined cluster is left running
    (only this driver disconnects)."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None and node.is_head():
        node.kill_monitor(check_alive=False)
    ray.shutdown()


@contextlib.contextmanager
def _single_node_switch() -> Iterator[None]:
    """Ray's switch for a cluster of one node off for this process (its constant, which
    ``ray.init`` reads) and for the processes the cluster starts (the variable), then back."""
    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR  # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    before_constant, before_variable = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(name)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[name] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_constant
        if before_variable is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before_variable


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address`` (``lo`` for 127.0.0.1 on Linux), or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    return None


def bind_to(address: str) -> None:
    """Point what listens on its own in an actor at ``address``, its node's address (127.0.0.1
    on one node): gloo and NCCL's sockets (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, the
    interface holding it) and vLLM's (``VLLM_HOST_IP``). Variables already set win."""
    os.environ.setdefault("VLLM_HOST_IP", address)
    interface = interface_of(address)
    if interface is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, interface)


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
