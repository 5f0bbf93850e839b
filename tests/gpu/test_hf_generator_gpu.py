"""The HF generator's GPU decode (static cache, one CUDA graph replay per step) against its
dynamic-cache decode: the same tokens and logprobs, the logprobs the model's own."""

from __future__ import annotations

import pytest
import torch

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.generation import SamplingParams
from tandem.generation.hf_generator import HfGenerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_graphed_decode_matches_the_dynamic_cache() -> None:
    generator = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32")
    prompts = [generator.tokenizer.encode(p) for p in ["17+25=", "3-1=", "99+99=", "7*8="]]
    params = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=3)
    graphed = generator.generate(prompts, params)
    assert generator.cuda_graphs  # the capture held
    generator.static_cache = generator.cuda_graphs = False
    dynamic = generator.generate(prompts, params)
    assert [r.response_token_ids for r in graphed] == [r.response_token_ids for r in dynamic]
    assert max(len(r.response_token_ids) for r in graphed) > 2
    for g, d in zip(graphed, dynamic, strict=True):
        assert g.response_logprobs == pytest.approx(d.response_logprobs, abs=1e-4)
        ids = torch.tensor([g.prompt_token_ids + g.response_token_ids], device="cuda:0")
        with torch.no_grad():
            logits = generator.model(ids).logits[0, len(g.prompt_token_ids) - 1 : -1].float()
        response = torch.tensor(g.response_token_ids, device="cuda:0")[:, None]
        direct = torch.log_softmax(logits, -1).gather(-1, response)[:, 0]
        assert g.response_logprobs == pytest.approx(direct.tolist(), abs=1e-4)
