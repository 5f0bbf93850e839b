"""A generator actor killed for real (SIGKILL on its process) in the middle of a GRPO step: the
``tandem grpo`` command exits 1 with one message naming the actor, the last complete checkpoint
is intact, and ``--resume`` reproduces the uninterrupted run's metrics exactly (CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_grpo import small_config, stable

from tandem.config import save_resolved
from tandem.driver import run_grpo
from tandem.rewards import exact_match

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = [
    "algorithm.num_steps=4",
    "checkpoint.every=1",
    "checkpoint.keep=3",
    "cluster.runtime=ray",  # actors to kill
]
KILLED = False


def kill_generator_after_step_2(prompt: str, response: str, answer: str) -> float:
    """exact_match; once step 2's checkpoint is complete (so during step 3's scoring), SIGKILL
    the generator actor's process. Runs in the driver (``data.num_reward_workers=0``)."""
    global KILLED
    done = Path(os.environ["TANDEM_TEST_RUN"]) / "checkpoints" / "step_2" / "COMPLETE"
    if not KILLED and done.exists():
        from ray._private.state import actors

        for actor in actors().values():
            if actor["Name"].startswith("generator-") and actor["State"] == "ALIVE":
                os.kill(actor["Pid"], signal.SIGKILL)
                KILLED = True
    return exact_match(prompt, response, answer)


def test_a_killed_generator_is_named_and_resume_reproduces_the_run(
    tmp_path: Path, ray_cluster: None
) -> None:
    run = tmp_path / "resumed"
    config = small_config(tmp_path, "resumed", *STEPS)
    save_resolved(config, tmp_path / "recipe")  # the same run, as a recipe for the command
    command = [
        sys.executable,
        "-m",
        "tandem.cli",
        "grpo",
        "-c",
        str(tmp_path / "recipe/config.yaml"),
    ]
    reward = [f"data.reward={__name__}:kill_generator_after_step_2", "data.num_reward_workers=0"]
    env = {
        **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},  # its own Ray cluster
        "TANDEM_TEST_RUN": str(run),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    killed = subprocess.run(
        [*command, *reward], capture_output=True, text=True, timeout=900, env=env
    )
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert "Traceback" not in killed.stderr
    assert killed.stderr.count("tandem grpo: error: ") == 1
    assert "generator worker rank 0 failed" in killed.stderr and "actor died" in killed.stderr

    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_2"  # step 3 never completed; step 2 is whole
    assert (run / "checkpoints" / "step_2" / "COMPLETE").exists()

    resumed = run_grpo(config, resume=True)
    straight = run_grpo(small_config(tmp_path, "straight", *STEPS))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert stable(resumed) == stable(straight)
