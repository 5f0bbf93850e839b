"""The HF generator's GPU decode (static cache, one CUDA graph replay per step) against its
dynamic-cache decode: the same tokens and logprobs, the logprobs the model's own; and an
in-flight refit under it (the re-prefill after new weights captures a new graph)."""

from __future__ import annotations

import pytest
import torch
from in_flight import (
    check_versions_and_logprobs,
    forward_logprobs,
    generate_two_positions_a_call,
    generate_with_refit_after,
    perturbed,
    sliding_window_model,
)

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.generation import SamplingParams
from tandem.generation.hf_generator import HfGenerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("bucket", [256, 4])
def test_graphed_decode_matches_the_dynamic_cache(
    bucket: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with windows of 4 positions: a graph per window (and per compaction), each step
    attending over the positions written so far, grouped heads folded (``register_gqa_sdpa``)."""
    from tandem.generation import static_decode

    monkeypatch.setattr(static_decode, "CACHE_BUCKET", bucket)
    generator = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32")
    prompts = [generator.tokenizer.encode(p) for p in ["17+25=", "3-1=", "99+99=", "7*8="]]
    params = SamplingParams(temperature=2.0, max_tokens=12, n=4, seed=3)  # (lengths 2-12)
    graphed = generator.generate(prompts, params)
    assert generator.cuda_graphs  # the captures held
    generator.static_cache = generator.cuda_graphs = False
    dynamic = generator.generate(prompts, params)
    assert [r.response_token_ids for r in graphed] == [r.response_token_ids for r in dynamic]
    assert max(len(r.response_token_ids) for r in graphed) > 2
    for g, d in zip(graphed, dynamic, strict=True):
        assert g.response_logprobs == pytest.approx(d.response_logprobs, abs=1e-4)
        direct = forward_logprobs(generator.model, g)  # the model's own
        assert g.response_logprobs == pytest.approx(direct, abs=1e-4)


def test_a_decode_under_a_byte_budget_grows_its_cache_and_parks_rows_under_cuda_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the CPU test of the bounded decode, with the captures real: a graph over each grown
    storage, rows parked and resumed, and the samples of the decode without a bound."""
    from tandem.generation import static_decode
    from tandem.generation.kv_cache import (
        DECODE_HEADROOM,
        PREFILL_TOKENS,
        prefill_bytes,
        row_bytes,
    )

    monkeypatch.setattr(static_decode, "CACHE_BUCKET", 4)
    generator = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32")
    prompts = [generator.tokenizer.encode(p, add_special_tokens=False) for p in ["17+25=", "3-1="]]
    params = SamplingParams(temperature=10.0, max_tokens=64, n=8, seed=5)
    whole = generator.generate(prompts, params)
    config, width = generator.model.config, max(len(p) for p in prompts)
    grow = 1 + 1 / config.num_hidden_layers
    budget = int(16 * row_bytes(config, torch.float32, width, 2) * grow) + 1
    shared = prefill_bytes(config, torch.float32, PREFILL_TOKENS)  # a prefill call's room
    monkeypatch.setattr(generator, "_free_bytes", lambda: DECODE_HEADROOM + shared + budget)
    generator.take_stats()
    bounded = generator.generate(prompts, params)
    assert generator.cuda_graphs  # the captures held
    assert generator.take_stats()["throughput/decode_parked"] > 0
    assert [r.response_token_ids for r in bounded] == [r.response_token_ids for r in whole]
    for b, w in zip(bounded, whole, strict=True):
        assert b.response_logprobs == pytest.approx(w.response_logprobs, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_in_flight_refit_under_cuda_graphs(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows prefilled again with the new weights in calls of 8 tokens (a row in chunks of
    positions), the steps after them graphed."""
    from tandem.generation import kv_cache

    monkeypatch.setattr(kv_cache, "PREFILL_TOKENS", 8)
    gen = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32")
    new = perturbed(seed=1)
    texts = ["17+25=", "3-1=", "Question: 12*3?\n"]  # as the CPU test's
    prompts = [gen.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)

    def refit() -> None:
        with gen.gate.update(version=1):
            gen.load_weights(iter(new.items()))

    rollouts = generate_with_refit_after(gen, (gen, "_sample"), k, refit, prompts, params)
    assert gen.cuda_graphs  # the captures held, before and after the re-prefill
    assert max(len(r.response_token_ids) for r in rollouts) > k
    old_model, new_model = HfGenerator(DEFAULT_MODEL_DIR), HfGenerator(DEFAULT_MODEL_DIR)
    new_model.load_weights(iter(new.items()))
    check_versions_and_logprobs(rollouts, k, old_model.model, new_model.model, atol=1e-4)


def test_sleep_frees_the_device_and_wake_up_gives_the_same_samples() -> None:
    """Colocated with a trainer the generator sleeps while it trains: nothing of it stays on
    the device (weights on the host, the last decode's cache handed back), and after
    ``wake_up`` it samples what it sampled before, from the same parameter objects."""
    from tandem.tensors.devices import release_device_caches

    release_device_caches()
    before, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    generator = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32")
    prompts = [generator.tokenizer.encode(p) for p in ["17+25=", "3-1=", "99+99="]]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=5)
    first = generator.generate(prompts, params)
    objects = [id(p) for p in generator.model.parameters()]
    assert generator.supports_sleep
    generator.sleep()
    assert torch.cuda.memory_allocated() <= before
    assert torch.cuda.memory_reserved() <= reserved
    generator.wake_up(["weights"])
    generator.wake_up(["kv_cache"])
    assert [id(p) for p in generator.model.parameters()] == objects
    again = generator.generate(prompts, params)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in first]
    assert [r.response_logprobs for r in again] == [r.response_logprobs for r in first]
    generator.sleep()  # a second sleep reuses the host copies of the first
    generator.wake_up()
    assert [r.response_token_ids for r in generator.generate(prompts, params)] == [
        r.response_token_ids for r in first
    ]


def test_a_deep_sleep_frees_the_device_without_a_host_copy_of_the_weights() -> None:
    """``sleep_level=2``: nothing of the generator stays on the device, only its buffers go to
    the host, and after a refit of the same weights it samples what it sampled before."""
    from tandem.tensors.devices import release_device_caches

    release_device_caches()
    before = torch.cuda.memory_allocated()
    generator = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32", sleep_level=2)
    prompts = [generator.tokenizer.encode(p) for p in ["17+25=", "3-1=", "99+99="]]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=5)
    first = generator.generate(prompts, params)
    weights = {n: p.detach().cpu() for n, p in generator.model.named_parameters()}
    generator.sleep()
    assert torch.cuda.memory_allocated() <= before
    assert generator._asleep is not None
    assert generator._asleep.nbytes < sum(t.nbytes for t in weights.values()) // 100
    generator.wake_up()
    generator.load_weights(iter(weights.items()))
    again = generator.generate(prompts, params)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in first]
    assert [r.response_logprobs for r in again] == [r.response_logprobs for r in first]


def test_compiled_layers_decode_under_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generation.compile``: the decode through compiled decoder layers (Triton kernels)
    captured and replayed per batch size and window (windows of 4 positions: many captures),
    the captures holding, with the eager decode's tokens and logprobs (fp32)."""
    from tandem.generation import static_decode

    monkeypatch.setattr(static_decode, "CACHE_BUCKET", 4)
    eager = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32")
    compiled = HfGenerator(DEFAULT_MODEL_DIR, device="cuda:0", dtype="float32", compile_layers=True)
    prompts = [eager.tokenizer.encode(p) for p in ["17+25=", "3-1=", "99+99=", "7*8="]]
    params = SamplingParams(temperature=2.0, max_tokens=12, n=4, seed=3)
    try:
        expected = eager.generate(prompts, params)
        got = compiled.generate(prompts, params)
        again = compiled.generate(prompts, params)  # the compiled graphs and the captures again
    finally:
        torch._dynamo.reset()
    assert compiled._compiled and compiled.cuda_graphs  # compiled, and the captures held
    assert [r.response_token_ids for r in got] == [r.response_token_ids for r in expected]
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in got]
    for g, e in zip(got, expected, strict=True):
        assert g.response_logprobs == pytest.approx(e.response_logprobs, rel=1e-4, abs=1e-4)


def test_a_model_of_sliding_windows_prefills_in_chunks_of_positions_on_the_gpu(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model of sliding windows decodes over transformers' own cache (not the windowed
    static one) and, on a GPU, prefills all its rows in chunks of positions of at most
    ``PREFILL_TOKENS`` tokens: the samples and logprobs of one whole prefill, the logprobs the
    model's own over the whole sequence."""
    import shutil

    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
    sliding_window_model(base).save_pretrained(tmp_path)
    for name in DEFAULT_MODEL_DIR.iterdir():  # the tokenizer's files
        if "token" in name.name and not (tmp_path / name.name).exists():
            shutil.copy(name, tmp_path / name.name)
    generator = HfGenerator(tmp_path, device="cuda:0", dtype="float32")
    assert generator.static_cache and not generator._windowed() and generator._chunked_prefill()
    texts = ["17+25=", "3-1=", "Question: 12*3?\n", "99+99="]
    prompts = [generator.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(temperature=2.0, max_tokens=16, n=4, seed=3)
    whole = generator.generate(prompts, params)  # one call: PREFILL_TOKENS >> the prompts
    chunked = generate_two_positions_a_call(generator, prompts, params, monkeypatch)
    assert [r.response_token_ids for r in chunked] == [r.response_token_ids for r in whole]
    assert max(len(r.response_token_ids) for r in chunked) > 4  # decoded past a window
    for c, w in zip(chunked, whole, strict=True):
        assert c.response_logprobs == pytest.approx(w.response_logprobs, rel=1e-4, abs=1e-4)
        direct = forward_logprobs(generator.model, c)  # the model's own
        assert c.response_logprobs == pytest.approx(direct, abs=1e-4)
