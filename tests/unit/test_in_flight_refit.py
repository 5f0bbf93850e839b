"""In-flight refit with the transformers generator: new weights land between two decode steps of
a running generation; the tokens before carry the old model's logprobs, the tokens from there on
the new model's (checked against plain forward passes of each model over the whole sequence)."""

from __future__ import annotations

import threading
import time

import pytest
from in_flight import check_versions_and_logprobs, generate_with_refit_after, perturbed

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.models import GenerationConfig
from tandem.generation import SamplingParams, make_generator
from tandem.generation.base import WeightGate
from tandem.generation.hf_generator import HfGenerator

PROMPTS = ["17+25=", "3-1=", "Question: 12*3?\n"]


def _hf() -> HfGenerator:
    gen = make_generator(GenerationConfig(backend="hf"), DEFAULT_MODEL_DIR)
    assert isinstance(gen, HfGenerator)
    return gen


@pytest.mark.parametrize("k", [1, 3])
def test_weights_swapped_mid_generation_take_over_from_the_next_step(k: int) -> None:
    gen, reference = _hf(), _hf()
    new = perturbed(seed=1)
    ids = [gen.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)

    def refit() -> None:
        with gen.gate.update(version=1):
            gen.load_weights(iter(new.items()))

    rollouts = generate_with_refit_after(gen, (gen, "_sample"), k, refit, ids, params)
    assert gen.gate.version == 1
    assert max(len(r.response_token_ids) for r in rollouts) > k
    new_reference = _hf()
    new_reference.load_weights(iter(new.items()))
    check_versions_and_logprobs(rollouts, k, reference.model, new_reference.model, atol=1e-4)
    # the decode went on from the new weights' own KV cache: what the new model would sample
    # given the same first k tokens, and the same seeds
    again = new_reference.generate(ids, params)
    for r, n in zip(rollouts, again, strict=True):
        if r.response_token_ids[:k] == n.response_token_ids[:k]:
            assert r.response_token_ids == n.response_token_ids


def test_an_update_waiting_at_the_gate_goes_before_the_next_step() -> None:
    gate = WeightGate()
    order: list[str] = []
    with gate.step() as version:
        assert version == 0
        updater = threading.Thread(target=lambda: _update(gate, order))
        updater.start()
        while gate.waiting_updates == 0:
            time.sleep(0.001)
        order.append("step 0 ends")
    with gate.step() as version:  # waits for the update
        order.append(f"step 1 runs version {version}")
    updater.join()
    assert order == ["step 0 ends", "update", "step 1 runs version 7"]
    with gate.update():  # None keeps the label (the same policy sent again)
        pass
    assert gate.version == 7


def _update(gate: WeightGate, order: list[str]) -> None:
    with gate.update(version=7):
        order.append("update")


def test_weights_swapped_after_stopped_rows_left_the_decode() -> None:
    """The refit lands once the decode has dropped its stopped rows (``COMPACT_AT``): the
    rows still decoding are prefilled again with the new weights and go on from there."""
    gen, reference = _hf(), _hf()
    new = perturbed(seed=2)
    ids = [gen.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=8, seed=5)
    calls: list[tuple[int, int]] = []  # (rows, tokens) of each model call

    def record(_module: object, _args: object, kwargs: dict) -> None:
        calls.append(tuple(kwargs["input_ids"].shape))  # type: ignore[arg-type]

    def refit() -> None:
        with gen.gate.update(version=1):
            gen.load_weights(iter(new.items()))

    hook = gen.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        rollouts = generate_with_refit_after(gen, (gen, "_sample"), 3, refit, ids, params)
    finally:
        hook.remove()
    prefills = [rows for rows, tokens in calls if tokens > 1]
    assert len(prefills) == 2 and prefills[1] < 24  # the second one: the rows left, new weights
    assert max(len(r.response_token_ids) for r in rollouts) > 3
    new_reference = _hf()
    new_reference.load_weights(iter(new.items()))
    check_versions_and_logprobs(rollouts, 3, reference.model, new_reference.model, atol=1e-4)


@pytest.mark.parametrize("windowed", [True, False], ids=["windowed", "transformers-cache"])
def test_a_refit_prefills_the_gpu_decode_again_in_bounded_calls(
    monkeypatch: pytest.MonkeyPatch, windowed: bool
) -> None:
    """The GPU's decode (run on the CPU here: the windowed static cache, and the decode of a
    model of sliding windows, over transformers' own cache) under an in-flight refit: the rows
    are prefilled again with the new weights, prompt and tokens so far, in model calls of at
    most ``PREFILL_TOKENS`` tokens (rows in groups and a row in chunks of positions; all rows
    in chunks of positions), and each token's logprob is that of the model that sampled it."""
    from tandem.generation import kv_cache

    gen, reference = _hf(), _hf()
    new = perturbed(seed=3)
    ids = [gen.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)
    calls: list[tuple[int, int]] = []  # (rows, positions) of each model call

    def refit() -> None:
        with gen.gate.update(version=1):
            gen.load_weights(iter(new.items()))

    tokens = 8
    monkeypatch.setattr(kv_cache, "PREFILL_TOKENS", tokens)
    gen.static_cache = windowed
    monkeypatch.setattr(gen, "_chunked_prefill", lambda: True)
    hook = gen.model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        rollouts = generate_with_refit_after(gen, (gen, "_sample"), 3, refit, ids, params)
    finally:
        hook.remove()
    steps = [i for i, (_, positions) in enumerate(calls) if positions == 1]
    again = [calls[i] for i in range(steps[0], len(calls)) if calls[i][1] > 1]
    assert again and len(again) > len({len(p) for p in ids})  # rows prefilled again, in parts
    assert all(rows * positions <= tokens for rows, positions in calls)
    assert max(len(r.response_token_ids) for r in rollouts) > 3
    new_reference = _hf()
    new_reference.load_weights(iter(new.items()))
    check_versions_and_logprobs(rollouts, 3, reference.model, new_reference.model, atol=1e-4)
