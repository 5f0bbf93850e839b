"""The local Ray cluster a run starts: no idle workers in the driver's environment.

Ray starts one idle Python worker per CPU for the first driver, in the driver's environment.
tandem's actors run in their own environments (or with their own variables), so those workers
are never used; on a 2-core machine their imports took 3 CPU-seconds of the actors' start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.ray

DRIVER = """
import sys
from tandem.cluster.ray_cluster import init_ray
init_ray(num_cpus=2)
print("up", flush=True)
sys.stdin.read()  # stay connected until the test closes stdin
"""


def workers_under(root: psutil.Process) -> list[str]:
    """Command lines of Ray's Python workers (``default_worker.py``) under ``root``."""
    found = []
    for process in root.children(recursive=True):
        try:
            command = process.cmdline()
        except psutil.Error:
            continue
        # a worker runs default_worker.py, then renames itself ray::IDLE (the raylet's own
        # command line names default_worker.py inside an option)
        if any(arg.endswith("default_worker.py") for arg in command) or (
            command and command[0].startswith("ray::IDLE")
        ):
            found.append(" ".join(command)[:120])
    return found


def test_a_local_cluster_starts_no_idle_workers() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster
    with subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as driver:
        assert driver.stdout is not None and driver.stdin is not None
        assert driver.stdout.readline().strip() == "up"
        root = psutil.Process(driver.pid)
        seen: list[str] = []
        deadline = time.monotonic() + 5  # prestarted workers appear within a second or two
        while time.monotonic() < deadline and not seen:
            seen = workers_under(root)
            time.sleep(0.2)
        raylets = [p for p in root.children(recursive=True) if "raylet" in p.name()]
        driver.stdin.close()
        driver.wait(timeout=60)
    assert raylets, "the driver started no raylet: the listing looked at nothing"
    assert seen == [], f"idle workers started in the driver's environment: {seen}"


STOPPING_DRIVER = """
import json
import ray
from tandem.cluster.ray_cluster import init_ray, shutdown_ray
init_ray(num_cpus=2)
node = ray._private.worker._global_node
pids = {kind: [info.process.pid for info in infos] for kind, infos in node.all_processes.items()}
shutdown_ray()
print(json.dumps({"pids": pids, "up": ray.is_initialized()}), flush=True)
"""


def test_shutdown_ray_stops_every_process_of_the_cluster() -> None:
    """``shutdown_ray`` (what the ``tandem`` command calls at its end) kills the autoscaler
    monitor itself before Ray's shutdown: the monitor and every other process of the cluster
    are gone when it returns."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", STOPPING_DRIVER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["up"] is False
    assert {"monitor", "raylet", "gcs_server"} <= set(report["pids"]), report
    alive = []
    for kind, pids in report["pids"].items():
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(kind)
            except psutil.NoSuchProcess:
                pass
    assert alive == [], f"left running: {alive}"


PRIORITY_DRIVER = """
import json
import os
import ray
from tandem.cluster.ray_cluster import init_ray, shutdown_ray
init_ray(num_cpus=2)
niceness = ray.get(ray.remote(num_cpus=0.5)(lambda: os.nice(0)).remote())
shutdown_ray()
print(json.dumps({"driver": os.nice(0), "actor": niceness}), flush=True)
"""


@pytest.mark.parametrize("driver_niceness", [0, 3])
def test_actors_of_a_local_cluster_run_at_the_drivers_priority(driver_niceness: int) -> None:
    """Ray runs its workers at niceness 15 unless told otherwise; on a machine shared with other
    work they then lose the cores to everything else. A local cluster's actors keep the
    driver's niceness (a driver started with ``nice -n 3`` gives its actors 3, not 18)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        ["nice", "-n", str(driver_niceness), sys.executable, "-c", PRIORITY_DRIVER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    base = os.nice(0)  # the test's own (pytest may itself run niced)
    assert report == {"driver": base + driver_niceness, "actor": base + driver_niceness}
