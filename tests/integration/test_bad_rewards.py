"""Reward functions that misbehave inside a real run (``tandem grpo``, workers in its process): one
that raises shows the user's own traceback once, one that returns NaN or a string stops the run
naming the sample; each exits with status 2 and a single error message, before any checkpoint."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]


def raises(prompt: str, response: str, answer: str) -> float:
    return float(int("not a number"))  # the user's own bug


def returns_nan(prompt: str, response: str, answer: str) -> float:
    return math.nan


def returns_text(prompt: str, response: str, answer: str) -> object:
    return "1.0"


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        ("raises", 'return float(int("not a number"))'),
        ("returns_nan", "returned nan, not a finite number"),
        ("returns_text", "returned str '1.0', not a finite number"),
    ],
)
def test_a_misbehaving_reward_ends_the_run_with_one_message(
    reward: str, expected: str, tmp_path: Path
) -> None:
    overrides = [
        "cluster.runtime=in_process",
        f"logging.run_dir={tmp_path}",
        "logging.name=run",
        "logging.progress=false",
        "logging.tensorboard=false",
        "algorithm.num_steps=1",
        "algorithm.prompts_per_step=2",
        "algorithm.num_generations=2",
        "algorithm.eval_every=0",
        "generation.kv_cache_bytes=33554432",
        f"data.reward={__name__}:{reward}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "grpo", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("tandem grpo: error: ") == 1
    assert expected in result.stderr
    assert result.stderr.count("Traceback") == (1 if reward == "raises" else 0)
    assert "response=" in result.stderr  # the sample is named
    assert not (tmp_path / "run" / "checkpoints").exists()
