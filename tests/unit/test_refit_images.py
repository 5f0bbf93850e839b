"""The vision tower and its projector refit with the language model: after training steps that
move every weight, a generator that received only the language model's weights scores image
prompts differently from the trainer, one that received the whole stream within 1e-5 (fp32)."""

from __future__ import annotations

import torch
from test_trainer_images import _config, _prompts
from test_trainer_support import token_nll

from tandem.algorithms.rollouts import rollouts_to_batch
from tandem.assets import VISUAL_MODEL_DIR
from tandem.generation.base import SamplingParams
from tandem.generation.hf_generator import HfGenerator
from tandem.trainer import PolicyTrainer


def _gap(generator: HfGenerator, trainer: PolicyTrainer) -> float:
    rollouts = generator.generate(_prompts(4), SamplingParams(max_tokens=4, n=2, seed=1))
    batch = rollouts_to_batch(rollouts, pad_token_id=256)
    assert batch.generator_logprobs is not None
    gap = (trainer.logprobs(batch) - batch.generator_logprobs).abs() * batch.loss_mask
    return float(gap.max())


def test_the_vision_tower_refits_with_the_language_model() -> None:
    trainer = PolicyTrainer(_config(micro_batch_size=4))
    generator = HfGenerator(VISUAL_MODEL_DIR)
    rollouts = generator.generate(_prompts(4), SamplingParams(max_tokens=4, n=2, seed=0))
    batch = rollouts_to_batch(rollouts, pad_token_id=256)
    for _ in range(3):
        trainer.train(batch, token_nll)
    names = [name for name, _ in trainer.iter_weights()]
    assert sum(".visual." in n for n in names) >= 20  # blocks, patch embedding, merger
    generator.load_weights((n, t) for n, t in trainer.iter_weights() if ".visual." not in n)
    without_tower = _gap(generator, trainer)
    generator.load_weights(trainer.iter_weights())
    assert _gap(generator, trainer) <= 1e-5 < without_tower
    state = generator.model.state_dict()
    for name, tensor in trainer.iter_weights():
        assert torch.equal(state[name], tensor), name
