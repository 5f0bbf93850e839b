"""The transformers generator on image prompts: the trainer's logprobs of its samples (fp32,
within 1e-5), transformers' own greedy decode, per-sample seeds that do not depend on the
batch, and rollouts that carry their images to the trainer's batch."""

from __future__ import annotations

import pytest
import torch
from test_trainer_images import _prompts

from tandem.algorithms.rollouts import rollouts_to_batch
from tandem.assets import VISUAL_MODEL_DIR
from tandem.config.models import PolicyConfig
from tandem.data.images import ImagePrompt
from tandem.generation import hf_generator
from tandem.generation.base import SamplingParams
from tandem.generation.hf_generator import HfGenerator
from tandem.trainer import PolicyTrainer


@pytest.fixture(scope="module")
def generator() -> HfGenerator:
    return HfGenerator(VISUAL_MODEL_DIR, max_batch_size=8)


def test_the_trainer_scores_the_samples_as_the_generator_did(generator: HfGenerator) -> None:
    prompts = _prompts(3)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=11)
    rollouts = generator.generate(prompts, params)  # 12 rows: batches of 8 and 4
    assert all(isinstance(r.prompt_token_ids, ImagePrompt) for r in rollouts)
    batch = rollouts_to_batch(rollouts, pad_token_id=256)
    assert batch.images is not None and batch.generator_logprobs is not None
    trainer = PolicyTrainer(PolicyConfig(model_path=VISUAL_MODEL_DIR, micro_batch_size=5))
    gap = (trainer.logprobs(batch) - batch.generator_logprobs).abs() * batch.loss_mask
    assert batch.loss_mask.sum() >= 12 and float(gap.max()) <= 1e-5


def test_greedy_decoding_matches_transformers_generate(generator: HfGenerator) -> None:
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=5, n=1, seed=0)
    ours = [r.response_token_ids for r in generator.generate(prompts, params)]
    for prompt, tokens in zip(prompts, ours, strict=True):
        ids = torch.tensor([list(prompt)])
        out = generator.model.generate(
            input_ids=ids,
            pixel_values=prompt.images.pixel_values,
            image_grid_thw=prompt.images.image_grid_thw,
            mm_token_type_ids=(ids == 259).int(),
            max_new_tokens=5,
            do_sample=False,
        )
        expected = out[0, ids.shape[1] :].tolist()
        assert tokens == expected[: len(tokens)] and len(tokens) >= 1


def test_a_sample_does_not_depend_on_the_batch_around_it(generator: HfGenerator) -> None:
    prompts = _prompts(3)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=5)
    together = generator.generate(prompts, params)
    alone = generator.generate(prompts[:1], params)
    for a, b in zip(alone, together[:2], strict=True):
        assert a.response_token_ids == b.response_token_ids
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-6)


def test_the_static_cache_decode_samples_as_the_dynamic_one(generator: HfGenerator) -> None:
    """The GPU's decode (a static KV cache read in windows) on image prompts, run on the CPU:
    the same samples as the dynamic cache, the trainer's logprobs within 1e-5."""
    prompts = _prompts(3)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7)
    dynamic = generator.generate(prompts, params)
    generator.static_cache = True
    try:
        static = generator.generate(prompts, params)
    finally:
        generator.static_cache = False
    assert [r.response_token_ids for r in static] == [r.response_token_ids for r in dynamic]
    batch = rollouts_to_batch(static, pad_token_id=256)
    assert batch.generator_logprobs is not None
    trainer = PolicyTrainer(PolicyConfig(model_path=VISUAL_MODEL_DIR, micro_batch_size=9))
    gap = (trainer.logprobs(batch) - batch.generator_logprobs).abs() * batch.loss_mask
    assert float(gap.max()) <= 1e-5


@pytest.mark.xdist_group("inductor")  # one worker, one after another: Inductor compiles once
def test_compiled_layers_sample_image_prompts_as_the_eager_decode(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generation.compile`` on a vision-language model: its language model's layers trace
    (multimodal positions pass through them; torch's ``aot_eager`` backend here, which
    traces as Inductor does without compiling kernels: Inductor's own numerics are
    ``test_hf_generator.py``'s) and the static decode samples as the eager one."""
    monkeypatch.setattr(hf_generator, "COMPILE_BACKEND", "aot_eager")
    prompts = _prompts(3)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7)
    compiled = HfGenerator(VISUAL_MODEL_DIR, max_batch_size=8, compile_layers=True)
    generator.static_cache = compiled.static_cache = True
    try:
        eager = generator.generate(prompts, params)
        got = compiled.generate(prompts, params)
    finally:
        generator.static_cache = False
        torch._dynamo.reset()
    assert compiled._compiled
    assert [r.response_token_ids for r in got] == [r.response_token_ids for r in eager]
    for g, e in zip(got, eager, strict=True):
        assert g.response_logprobs == pytest.approx(e.response_logprobs, rel=1e-5, abs=1e-5)


def test_a_prompts_samples_share_one_prefill(generator: HfGenerator) -> None:
    """Rows of one image prompt (its ``n`` samples) are prefilled once; prompts of the same
    tokens with other images are not merged (the trainer's logprobs above would show it)."""
    prefills: list[int] = []

    def record(_: object, args: tuple, kwargs: dict) -> None:
        if kwargs.get("inputs_embeds") is not None:  # the prefill; decode steps pass ids
            prefills.append(int(kwargs["inputs_embeds"].shape[0]))

    hook = generator.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        prompts = _prompts(2)
        assert list(prompts[0]) == list(prompts[1])  # the same tokens, other images
        generator.generate(prompts, SamplingParams(temperature=1.0, max_tokens=3, n=4, seed=3))
    finally:
        hook.remove()
    assert prefills == [2]  # 8 rows, 2 distinct prompts
