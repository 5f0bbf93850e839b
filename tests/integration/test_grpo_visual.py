"""GRPO on the embedded visual task as a user runs it: ``tandem grpo --config grpo_visual``
with the trainer and generator in this process (the refit a copy) and as Ray actors (the
refit through the shared-memory transport); checkpoints, ``--resume`` and the exported folder
with its image processor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow]


def _grpo(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    args = [
        "grpo",
        "--config",
        "grpo_visual",
        "algorithm.num_steps=2",
        "algorithm.prompts_per_step=4",
        "algorithm.num_generations=4",
        "algorithm.eval_every=2",
        "data.num_eval_prompts=8",
        "policy.optimizer.lr=1e-2",  # every weight moves: a refit that missed one shows
        # the warm start answers with one digit: a reward of its value, sampled hot, gives every
        # group variance (a digit-fraction reward was 1 for every sample and trained nothing)
        "data.reward=e2e_rewards:first_digit",
        "generation.sampling.temperature=2.0",
        "checkpoint.every=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={tmp_path}",
        f"logging.name={name}",
        *extra,
    ]
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={"TANDEM_CACHE": str(tmp_path / "cache"), **_env()},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    ]
    return [row for row in rows if "train/loss" in row]


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "TANDEM_CACHE"}
    bench = str(Path(__file__).parents[2] / "bench")  # e2e_rewards
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [bench, env.get("PYTHONPATH")]))
    return env


def test_in_process_steps_refit_resume_and_export(tmp_path: Path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from tandem.assets import VISUAL_MODEL_DIR
    from tandem.data.images import VisionProcessor
    from tandem.data.visual import scenes

    steps = _grpo(tmp_path, "inproc", "cluster.runtime=in_process")
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["gen/logprob_mismatch"] < 1e-5 for row in steps), steps
    resumed = _grpo(
        tmp_path, "inproc", "--resume", "cluster.runtime=in_process", "algorithm.num_steps=3"
    )
    assert [row["step"] for row in resumed] == [1, 2, 3]  # the log kept, one step more
    export = tmp_path / "inproc" / "hf"
    assert (export / "preprocessor_config.json").is_file()
    model = AutoModelForImageTextToText.from_pretrained(export).eval()
    shipped = AutoModelForImageTextToText.from_pretrained(VISUAL_MODEL_DIR)
    name = "model.visual.blocks.0.mlp.up_proj.weight"
    assert not torch.equal(model.state_dict()[name], shipped.state_dict()[name])  # trained
    processor = VisionProcessor(export, AutoTokenizer.from_pretrained(export))
    assert type(processor.image_processor) is type(AutoImageProcessor.from_pretrained(export))
    prompt = processor("How many shapes?", [scenes(1, 0, held_out=True)[0].draw()])
    with torch.no_grad():
        model(
            input_ids=torch.tensor([list(prompt)]),
            pixel_values=prompt.images.pixel_values,
            image_grid_thw=prompt.images.image_grid_thw,
        )


def test_ray_actors_refit_the_vision_tower_through_the_transport(tmp_path: Path) -> None:
    steps = _grpo(tmp_path, "ray", "cluster.runtime=ray", "cluster.env_mode=shared")
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["gen/logprob_mismatch"] < 1e-5 for row in steps), steps
    assert all(row["refit/gb_per_s"] > 0 for row in steps)
