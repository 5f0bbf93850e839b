"""What a user sees of a run in the terminal: the run's own lines, not its processes' noise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray]


def test_a_run_on_ray_actors_prints_its_steps_and_no_noise_from_its_processes(
    tmp_path: Path,
) -> None:
    """(The same of a run in this process: ``test_in_process``.)"""
    command = [sys.executable, "-m", "tandem.cli", "grpo", "cluster.runtime=ray"]
    command += [
        "cluster.env_mode=shared",
        "generation.backend=vllm",  # the noisiest: its warnings go to the run's log
        "algorithm.num_steps=1",
        "algorithm.eval_every=0",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={tmp_path}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray cluster
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "step    1  loss" in output
    assert "workers: Ray actors, colocated" in output.replace("\n", " ")
    # the actors' weight-loading bars (which came after the last step) and nanobind's report of
    # triton objects left frozen at exit (sixty lines)
    for noise in ("Loading weights", "leaked"):
        assert noise not in output, output[-3000:]
    # vLLM's and Ray's warnings (a dozen lines before the first step) are in the run's log only
    assert "WARNING" not in output, output[-3000:]
    log = next(tmp_path.glob("grpo-*/logs/console.log")).read_text()
    assert "WARNING" in log and "vllm" in log.lower()
