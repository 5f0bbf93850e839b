import threading
from typing import Any

import pytest
import torch
from in_flight import generate_two_positions_a_call, sliding_window_model
from safetensors.torch import load_file

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.attention import GQA_SDPA
from tandem.config.models import GenerationConfig, RefitConfig, SamplingConfig
from tandem.generation import (
    Rollout,
    SamplingParams,
    group_rollouts,
    hf_generator,
    make_generator,
)
from tandem.generation.hf_generator import HfGenerator, filter_logits
from tandem.generation.kv_cache import GrowingLayer
from tandem.weight_sync import make_receiver, make_sender, metadata_of

PROMPTS = ["17+25=", "3-1=", "99+99="]


@pytest.fixture(scope="module")
def generator() -> HfGenerator:
    gen = make_generator(GenerationConfig(backend="hf"), DEFAULT_MODEL_DIR)
    assert isinstance(gen, HfGenerator)
    return gen


def _prompt_ids(gen: HfGenerator) -> list[list[int]]:
    return [gen.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def _direct_logprobs(gen: HfGenerator, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = gen.model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_greedy_is_deterministic_and_batch_independent(generator: HfGenerator) -> None:
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=0, max_tokens=6)
    eos = generator.tokenizer.eos_token_id
    batched = generator.generate(ids, params)
    assert [r.response_token_ids for r in batched] == [
        r.response_token_ids for r in generator.generate(ids, params)
    ]
    alone = [generator.generate([p], params)[0] for p in ids]  # no left padding
    assert [r.response_token_ids for r in batched] == [r.response_token_ids for r in alone]
    for b, a in zip(batched, alone, strict=True):
        assert b.response_logprobs == pytest.approx(a.response_logprobs, abs=1e-5)
        ran_out = b.finish_reason == "length" and len(b.response_token_ids) == 6
        ended = b.finish_reason == "stop" and b.response_token_ids[-1] == eos
        assert ran_out or ended


def test_n_samples_grouped_seeded_and_logprobs_match_forward(generator: HfGenerator) -> None:
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=7)
    rollouts = generator.generate(ids, params)
    groups = group_rollouts(rollouts, 4)
    assert [{r.prompt_index for r in g} for g in groups] == [{0}, {1}, {2}]
    assert len({tuple(r.response_token_ids) for r in groups[0]}) > 1  # random init: diverse
    again = generator.generate(ids, params)
    assert [r.response_token_ids for r in rollouts] == [r.response_token_ids for r in again]
    other_seed = generator.generate(ids, SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=8))
    assert [r.response_token_ids for r in rollouts] != [r.response_token_ids for r in other_seed]
    # a sample's stream depends on (seed, prompt, sample), not on the rest of the batch
    solo = generator.generate([ids[1]], SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=11))
    assert [r.response_token_ids for r in solo] == [r.response_token_ids for r in groups[1]]
    for r in rollouts:
        expected = _direct_logprobs(generator, r.prompt_token_ids, r.response_token_ids)
        assert torch.allclose(torch.tensor(r.response_logprobs), expected, atol=1e-5)


def test_eos_and_stop_strings(generator: HfGenerator) -> None:
    eos = generator.tokenizer.eos_token_id
    ids = _prompt_ids(generator)[:1]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    first = generator.generate(ids, greedy)[0]
    stop_text = generator.tokenizer.decode(first.response_token_ids[1:2])
    stopped = generator.generate(
        ids, SamplingParams(temperature=0, max_tokens=6, stop=(stop_text,))
    )
    assert stopped[0].finish_reason == "stop"
    assert stop_text not in stopped[0].response_text
    # the warm-started model ends its answers with EOS: kept in the ids, dropped from the text
    ended = generator.generate(ids, greedy)[0]
    assert ended.response_token_ids[-1] == eos and ended.finish_reason == "stop"
    assert ended.response_text == generator.tokenizer.decode(ended.response_token_ids[:-1])
    assert "<|endoftext|>" not in ended.response_text


def test_load_weights_changes_outputs_and_restores(generator: HfGenerator) -> None:
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=0, max_tokens=6)
    before = generator.generate(ids, params)
    original = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors"))
    torch.manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    generator.load_weights(iter(perturbed.items()))
    after = generator.generate(ids, params)
    assert [r.response_logprobs for r in after] != [r.response_logprobs for r in before]
    for r in after:  # the new weights are really in use
        expected = _direct_logprobs(generator, r.prompt_token_ids, r.response_token_ids)
        assert torch.allclose(torch.tensor(r.response_logprobs), expected, atol=1e-5)
    generator.load_weights(iter(original.items()))
    restored = generator.generate(ids, params)
    assert [r.response_token_ids for r in restored] == [r.response_token_ids for r in before]
    assert [r.response_logprobs for r in restored] == [r.response_logprobs for r in before]


def test_load_weights_rejects_unknown_names(generator: HfGenerator) -> None:
    with pytest.raises(ValueError, match="not a parameter"):
        generator.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        generator.load_weights([("model.norm.weight", torch.zeros(3))])


def test_filter_logits_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep_k = torch.isfinite(filter_logits(logits, SamplingParams(top_k=2)))
    assert keep_k.tolist() == [[True, True, False, False]]
    keep_p = torch.isfinite(filter_logits(logits, SamplingParams(top_p=0.7)))
    assert keep_p.tolist() == [[True, True, False, False]]
    keep_all = torch.isfinite(filter_logits(logits, SamplingParams(top_p=0.99)))
    assert keep_all.all()


def test_sampling_params_from_config_and_validation() -> None:
    params = SamplingParams.from_config(SamplingConfig(temperature=0.5, stop=["\n"]), n=8)
    assert (params.temperature, params.n, params.stop, params.max_tokens) == (0.5, 8, ("\n",), 64)
    assert params.sample_seed(2, 3) == 0 + 2 * 8 + 3


def test_receive_weights_through_a_refit_copies_bucket_by_bucket(generator: HfGenerator) -> None:
    """A colocated refit (a thread plays the trainer) lands in the model through batched copies
    (``RefitReceiver.copy_into``), bit-exact, over several buckets."""
    original = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors"))
    original.pop("lm_head.weight", None)  # tied: loaders re-tie it to the embedding
    torch.manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    sender = make_sender(RefitConfig(transport="colocated", bucket_bytes=2**18), "cpu")
    state = generator.model.state_dict()
    try:
        # The model's parameters lie back to back in one allocation, as the tensors of a bucket
        # do: streamed in the model's order (a trainer's), each bucket is one copy.
        named = dict(generator.model.named_parameters())
        assert len({p.untyped_storage().data_ptr() for p in named.values()}) == 1
        ordered = {name: perturbed[name] for name in named}
        spec = sender.prepare(metadata_of(ordered.items()))
        trainer = threading.Thread(target=sender.send, args=(iter(ordered.items()),))
        trainer.start()
        targets = [named[meta.name].detach() for meta in spec.plan.tensors]
        copies = make_receiver(spec, "cpu").copy_into(targets)
        trainer.join(timeout=60)
        assert copies == len(spec.plan.buckets) < len(original) // 2
        assert all(torch.equal(state[name], t) for name, t in ordered.items())
        # In the file's order (not the model's), then back to the original weights: the second
        # refit of that plan reuses the targets the first one worked out.
        kept = []
        for weights in (perturbed, original):
            spec = sender.prepare(metadata_of(weights.items()))
            assert len(spec.plan.buckets) > 3
            trainer = threading.Thread(target=sender.send, args=(iter(weights.items()),))
            trainer.start()
            generator.receive_weights(spec)
            trainer.join(timeout=60)
            assert all(torch.equal(state[name], t) for name, t in weights.items())
            kept.append(generator._refit_targets)
        assert kept[0] is kept[1] is not None
    finally:
        sender.close()


def test_sampling_draws_from_the_softmax_and_depends_only_on_key_and_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inverse-CDF draw: frequencies follow the softmax, filtered tokens never come,
    the logprob is the raw logits' one, and row b's draw is a function of (its logits, key b,
    step) whatever the rows around it and the block size; bf16 logits give the same."""
    from tandem.generation.hf_generator import sample_keys, sample_tokens

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0]).expand(40_000, 5)
    keys = sample_keys(list(range(40_000)), torch.device("cpu"))
    params = SamplingParams(temperature=1.0, top_k=4)
    draws, logprobs = sample_tokens(logits, keys, 3, params)
    frequencies = torch.bincount(draws, minlength=5).double() / len(draws)
    expected = [*torch.softmax(logits[0, :4], -1).tolist(), 0.0]
    assert frequencies.tolist() == pytest.approx(expected, abs=0.01)
    assert frequencies[4] == 0  # filtered out by top-k
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(-1, draws[:, None])[:, 0])
    monkeypatch.setattr(hf_generator, "SAMPLE_BLOCK", 15)  # three rows a block
    alone, _ = sample_tokens(logits[7:8], keys[7:8], 3, params)
    assert alone[0] == draws[7]
    blocked, _ = sample_tokens(logits[:100], keys[:100], 3, params)
    assert torch.equal(blocked, draws[:100])
    next_step, _ = sample_tokens(logits[:100], keys[:100], 4, params)
    assert not torch.equal(next_step, draws[:100])
    half, _ = sample_tokens(logits[:100].bfloat16(), keys[:100], 3, params)
    assert torch.equal(half, draws[:100])  # these logits are exact in bf16


def test_plain_sampling_reads_the_model_dtype_and_gives_raw_logprobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Temperature 1 without top-k/top-p (``_plain_draws``: one softmax of the bf16 logits
    into fp32): frequencies follow the softmax, the logprob is the raw log-softmax's within
    1e-5, and a row's draw does not depend on the block size or the rows around it."""
    from tandem.generation.hf_generator import sample_keys, sample_tokens

    generator = torch.Generator().manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    wide = torch.randn(4_000, 1_000, generator=generator).bfloat16()  # and a wide vocabulary
    for logits in (base.expand(40_000, 5).bfloat16(), wide):
        keys = sample_keys(list(range(len(logits))), torch.device("cpu"))
        draws, logprobs = sample_tokens(logits, keys, 3, SamplingParams())
        expected = torch.log_softmax(logits.float(), -1).gather(-1, draws[:, None])[:, 0]
        assert torch.allclose(logprobs, expected, atol=1e-5, rtol=0)
        monkeypatch.setattr(hf_generator, "SAMPLE_BLOCK", 3 * logits.shape[1])
        blocked, _ = sample_tokens(logits[:100], keys[:100], 3, SamplingParams())
        monkeypatch.undo()
        assert torch.equal(blocked, draws[:100])
    assert len(set(draws.tolist())) > 900  # (the wide ones) spread over the vocabulary
    keys = sample_keys(list(range(40_000)), torch.device("cpu"))
    draws, _ = sample_tokens(base.expand(40_000, 5).bfloat16(), keys, 3, SamplingParams())
    frequencies = torch.bincount(draws, minlength=5).double() / len(draws)
    assert frequencies.tolist() == pytest.approx(torch.softmax(base, -1).tolist(), abs=0.01)


def test_static_cache_decode_matches_the_dynamic_cache(generator: HfGenerator) -> None:
    """The GPU's decode path (static cache, prepared masks; graphs aside) run on the CPU: the
    same sampled tokens and logprobs as the dynamic cache, over left-padded prompts of three
    lengths, and the logprobs are the model's own on the full sequence."""
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=5)
    dynamic = generator.generate(ids, params)
    generator.static_cache = True
    try:
        static = generator.generate(ids, params)
    finally:
        generator.static_cache = False
    assert [r.response_token_ids for r in static] == [r.response_token_ids for r in dynamic]
    assert any(len(r.response_token_ids) > 2 for r in static)
    for s, d in zip(static, dynamic, strict=True):
        assert s.response_logprobs == pytest.approx(d.response_logprobs, abs=1e-5)
        direct = _direct_logprobs(generator, s.prompt_token_ids, s.response_token_ids)
        assert s.response_logprobs == pytest.approx(direct.tolist(), abs=1e-5)


def test_a_prompt_is_prefilled_once_for_its_samples(generator: HfGenerator) -> None:
    """``n`` samples of a prompt (and a prompt given twice) share one prefill row; the decode
    steps run every row. The tokens and logprobs stay the model's own (the test above checks
    them against a forward; the static cache, which prefills every row, against this path)."""
    ids = _prompt_ids(generator)
    rows: list[int] = []
    caches: list[object] = []

    def record(_module: object, _args: object, kwargs: dict) -> None:
        rows.append(kwargs["input_ids"].shape[0])
        caches.append(kwargs.get("past_key_values"))

    hook = generator.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        rollouts = generator.generate([*ids, ids[0]], SamplingParams(max_tokens=3, n=4, seed=3))
    finally:
        hook.remove()
    assert rows[0] == 3  # three distinct prompts
    assert rows[1] == 16 and len(rows) >= 2  # then every row (fewer once some have stopped)
    # the decode writes its KV cache in place (generation.kv_cache), every step the same one
    assert all(isinstance(layer, GrowingLayer) for layer in caches[0].layers)  # type: ignore[attr-defined]
    assert all(cache is caches[0] for cache in caches)
    for r in rollouts:
        expected = _direct_logprobs(generator, r.prompt_token_ids, r.response_token_ids)
        assert torch.allclose(torch.tensor(r.response_logprobs), expected, atol=1e-5)


def test_the_lm_head_gets_contiguous_rows_in_the_prefill_and_the_decode(
    generator: HfGenerator,
) -> None:
    """The prefill's last positions reach the LM head as a strided slice of the hidden states;
    the head gets them contiguous (a strided 3-D bf16 input times a frozen CPU weight takes a
    batched product ~200x slower: LoRA's frozen base). Every call, prefill and decode, and the
    same samples as a forward."""
    head = generator.model.get_output_embeddings()
    seen: list[tuple[tuple[int, ...], bool]] = []

    def record(_module: object, args: tuple[torch.Tensor, ...]) -> None:
        seen.append((tuple(args[0].shape), args[0].is_contiguous()))

    hook = head.register_forward_pre_hook(record)  # after the generator's own
    try:
        rollouts = generator.generate(_prompt_ids(generator), SamplingParams(max_tokens=3, seed=5))
    finally:
        hook.remove()
    assert seen[0][0] == (3, 1, generator.model.config.hidden_size)  # the prefill's rows
    assert len(seen) >= 2 and all(contiguous for _, contiguous in seen), seen
    for r in rollouts:
        expected = _direct_logprobs(generator, r.prompt_token_ids, r.response_token_ids)
        assert torch.allclose(torch.tensor(r.response_logprobs), expected, atol=1e-5)


def test_grouped_heads_are_attended_in_place_on_cpu(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model has 2 key/value heads for 4 query heads. transformers' sdpa copies
    them per query head whenever a mask is given (every step of a left-padded decode); the
    generator's attention on a CPU reads them in place, with the tokens and logprobs of the
    copying path."""
    import transformers.integrations.sdpa_attention as sdpa

    copies = 0
    repeat_kv = sdpa.repeat_kv

    def counted(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        nonlocal copies
        copies += 1
        return repeat_kv(hidden, n_rep)

    monkeypatch.setattr(sdpa, "repeat_kv", counted)
    ids = _prompt_ids(generator)  # three lengths: padded, so every step has a mask
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=5)
    assert generator.model.config.num_key_value_heads < generator.model.config.num_attention_heads
    in_place = generator.generate(ids, params)
    assert copies == 0
    generator.model.set_attn_implementation("sdpa")
    try:
        copied = generator.generate(ids, params)
    finally:
        generator.model.set_attn_implementation(GQA_SDPA)
    assert copies > 0  # the reference did take transformers' copying path
    assert [r.response_token_ids for r in in_place] == [r.response_token_ids for r in copied]
    for a, b in zip(in_place, copied, strict=True):
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-6)


def test_stopped_rows_leave_the_decode_with_the_same_samples(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a quarter of the rows has stopped, the CPU decode computes only the others
    (``COMPACT_AT``): the same tokens, logprobs and finish reasons as a decode that keeps
    every row to the end, and the logprobs are the model's own."""
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=1.0, max_tokens=12, n=8, seed=2)
    rows: list[int] = []

    def record(_module: object, _args: object, kwargs: dict) -> None:
        rows.append(kwargs["input_ids"].shape[0])

    hook = generator.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        compacted = generator.generate(ids, params)
        compacted_rows, rows[:] = list(rows), []
        monkeypatch.setattr(hf_generator, "COMPACT_AT", 0.0)
        whole = generator.generate(ids, params)
    finally:
        hook.remove()
    assert set(rows[1:]) == {24}  # every row to the end
    assert compacted_rows[1] == 24 and min(compacted_rows[1:]) < 18  # shrank past 3/4
    assert compacted_rows[1:] == sorted(compacted_rows[1:], reverse=True)
    assert [r.response_token_ids for r in compacted] == [r.response_token_ids for r in whole]
    assert [r.finish_reason for r in compacted] == [r.finish_reason for r in whole]
    assert len({len(r.response_token_ids) for r in compacted}) > 2  # ragged
    for c, w in zip(compacted, whole, strict=True):
        assert c.response_logprobs == pytest.approx(w.response_logprobs, abs=1e-5)
        direct = _direct_logprobs(generator, c.prompt_token_ids, c.response_token_ids)
        assert c.response_logprobs == pytest.approx(direct.tolist(), abs=1e-5)


def test_stopped_rows_leave_the_static_cache_decode(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's decode path (static cache; graphs aside) run on the CPU drops its stopped
    rows too: fewer rows per step as samples finish, and the same samples as a decode that
    keeps every row to the end."""
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=1.0, max_tokens=12, n=8, seed=2)
    rows: list[int] = []

    def record(_module: object, _args: object, kwargs: dict) -> None:
        rows.append(kwargs["input_ids"].shape[0])

    hook = generator.model.register_forward_pre_hook(record, with_kwargs=True)
    generator.static_cache = True
    try:
        compacted = generator.generate(ids, params)
        compacted_rows, rows[:] = list(rows), []
        monkeypatch.setattr(hf_generator, "COMPACT_AT", 0.0)
        whole = generator.generate(ids, params)
    finally:
        generator.static_cache = False
        hook.remove()
    assert set(rows) == {24}  # the static prefill runs every row; then every row to the end
    assert min(compacted_rows) < 18 and sum(compacted_rows) < sum(rows)
    assert compacted_rows == sorted(compacted_rows, reverse=True)
    assert [r.response_token_ids for r in compacted] == [r.response_token_ids for r in whole]
    assert [r.finish_reason for r in compacted] == [r.finish_reason for r in whole]
    for c, w in zip(compacted, whole, strict=True):
        assert c.response_logprobs == pytest.approx(w.response_logprobs, abs=1e-5)


def test_the_static_decode_reads_the_cache_in_windows_with_the_whole_reads_samples(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step of the static decode attends over the positions written so far rounded up to
    a bucket (``static_decode.CACHE_BUCKET``), not the whole cache: the same tokens and
    logprobs (within 1e-5, fp32) as a decode that reads the whole cache every step."""
    from tandem.generation import static_decode
    from tandem.generation.kv_cache import WindowedLayer

    reads: list[tuple[int, int]] = []  # (positions read, last position written + 1)
    update = WindowedLayer.update

    def recorded(self: WindowedLayer, *args: object, **kwargs: object) -> object:
        out = update(self, *args, **kwargs)  # type: ignore[arg-type]
        reads.append((self.keys.shape[-2], int(self.window.positions.max()) + 1))
        return out

    monkeypatch.setattr(WindowedLayer, "update", recorded)
    ids = _prompt_ids(generator)
    # hot enough that some of the trained model's answers run on (lengths 2-12)
    params = SamplingParams(temperature=2.0, max_tokens=12, n=3, seed=5)
    generator.static_cache = True
    try:
        monkeypatch.setattr(static_decode, "CACHE_BUCKET", 4)
        windowed = generator.generate(ids, params)
        windowed_reads, reads[:] = list(reads), []
        monkeypatch.setattr(static_decode, "CACHE_BUCKET", 1 << 20)
        whole = generator.generate(ids, params)
    finally:
        generator.static_cache = False
    width = max(len(p) for p in ids)
    capacity = width + params.max_tokens
    assert {read for read, _ in reads} == {width, capacity}  # the prefill, then everything
    layers = generator.model.config.num_hidden_layers
    steps = windowed_reads[layers::layers]  # each step's first layer, after the prefill's
    assert len(steps) > 4 and all(
        read == min(capacity, -(-needed // 4) * 4) for read, needed in steps
    )
    assert len({read for read, _ in steps}) > 2  # the window grew during the decode
    assert [r.response_token_ids for r in windowed] == [r.response_token_ids for r in whole]
    for w, a in zip(windowed, whole, strict=True):  # (the whole read's against a forward:
        # test_static_cache_decode_matches_the_dynamic_cache)
        assert w.response_logprobs == pytest.approx(a.response_logprobs, abs=1e-5)


def test_the_static_decode_holds_the_cache_its_rows_reached_and_parks_what_outgrows_it(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's decode under a byte budget (the device's free memory, given here): the rows
    whose first window fits decode together (a cache of every row to the cap would not fit:
    they would decode in chunks), the cache grows with the window and stays within the
    budget; where growing would not fit, rows wait and go on later from a prefill of what they
    had decoded. The samples are those of a decode without a bound."""
    from tandem.generation import static_decode
    from tandem.generation.kv_cache import (
        DECODE_HEADROOM,
        PREFILL_TOKENS,
        WindowedLayer,
        decode_rows,
        kv_bytes_per_position,
        prefill_bytes,
        row_bytes,
    )

    ids = _prompt_ids(generator)
    # so hot that most rows run to the cap
    params = SamplingParams(temperature=10.0, max_tokens=64, n=8, seed=5)
    width, config = max(len(p) for p in ids), generator.model.config
    layers = config.num_hidden_layers
    budget = int(24 * row_bytes(config, torch.float32, width, 2) * (1 + 1 / layers)) + 1
    # and room for a prefill call's activations beside the cache
    shared = prefill_bytes(config, torch.float32, PREFILL_TOKENS)
    free = DECODE_HEADROOM + budget + shared
    each = row_bytes(config, torch.float32, width, 64)
    assert decode_rows(24, 256, each, layers, free - shared) < 12
    held: list[tuple[int, int]] = []  # a decode step's (bytes of the cache, positions - window)
    update = WindowedLayer.update

    def recorded(self: WindowedLayer, *args: object, **kwargs: object) -> object:
        out = update(self, *args, **kwargs)  # type: ignore[arg-type]
        assert self.storage is not None
        storage = self.storage[0]
        if args[0].shape[2] == 1:  # type: ignore[attr-defined]
            held.append((2 * layers * storage.nbytes, storage.shape[2] - self.keys.shape[2]))
        return out

    calls: list[tuple[int, int]] = []  # (rows, positions) of each model call
    hook = generator.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    monkeypatch.setattr(static_decode, "CACHE_BUCKET", 4)
    generator.static_cache = True
    try:
        whole = generator.generate(ids, params)
        calls[:] = []
        monkeypatch.setattr(WindowedLayer, "update", recorded)
        monkeypatch.setattr(generator, "_free_bytes", lambda: free)
        generator.take_stats()
        bounded = generator.generate(ids, params)
        stats = generator.take_stats()
        parked = stats["throughput/decode_parked"]
    finally:
        generator.static_cache = False
        hook.remove()
    assert sum(len(r.response_token_ids) == 64 for r in whole) > 12
    prefills = [(i, shape) for i, shape in enumerate(calls) if shape[1] > 1]
    assert prefills[0] == (0, (24, width))  # every row in one decode
    resumed = prefills[1:]
    assert resumed and all(rows < 24 and positions > width for _, (rows, positions) in resumed)
    assert parked == sum(rows for _, (rows, _) in resumed)  # each waited once
    assert stats["throughput/decode_prefills"] == len(prefills)
    assert all(window == 0 for _, window in held)  # the storage is the window: it grew
    assert len({nbytes for nbytes, _ in held}) > 4
    assert max(nbytes for nbytes, _ in held) <= budget
    per_position = kv_bytes_per_position(config, torch.float32)
    assert max(nbytes for nbytes, _ in held) > per_position * 24 * (width + 2)
    assert [r.response_token_ids for r in bounded] == [r.response_token_ids for r in whole]
    assert [r.finish_reason for r in bounded] == [r.finish_reason for r in whole]
    assert [r.response_versions for r in bounded] == [r.response_versions for r in whole]
    for b, w in zip(bounded, whole, strict=True):  # (fp32: other batches, a prefill for steps)
        assert b.response_logprobs == pytest.approx(w.response_logprobs, rel=1e-4, abs=1e-5)


def test_a_prefill_runs_in_bounded_calls_once_the_decode_before_it_let_go_of_its_cache(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The windowed decode prefills in model calls of at most ``PREFILL_TOKENS`` tokens: its
    rows in groups, a row longer than that in chunks of positions (its later chunks attend the
    keys written before). A prefill again (rows resumed after parking here; a refit's rows
    alike) starts only once the decode before it has let go of its KV cache, so under a byte
    budget the caches alive at any call stay within it. The samples are those of prefills
    in one call."""
    import weakref

    from tandem.generation import kv_cache, static_decode

    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=10.0, max_tokens=64, n=8, seed=5)
    width, config = max(len(p) for p in ids), generator.model.config
    tokens = 5 * width  # rows of 5 prompts a call; a resumed row (> 5 x width) in chunks
    layers = config.num_hidden_layers
    budget = int(24 * kv_cache.row_bytes(config, torch.float32, width, 2) * (1 + 1 / layers))
    shared = kv_cache.prefill_bytes(config, torch.float32, tokens)
    monkeypatch.setattr(static_decode, "CACHE_BUCKET", 4)
    generator.static_cache = True
    try:
        whole = generator.generate(ids, params)
        storages: list[weakref.ref[torch.Tensor]] = []
        make = kv_cache._storage

        def recorded(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            made = make(*args, **kwargs)
            storages.extend(weakref.ref(tensor) for tensor in made)
            return made

        def alive() -> int:  # bytes of every KV cache not freed
            return sum(t.nbytes for ref in storages if (t := ref()) is not None)

        calls: list[tuple[int, int, int, int]] = []  # (rows, positions, keys, bytes alive)
        hook = generator.model.register_forward_pre_hook(
            lambda _m, _a, kw: calls.append(
                (*kw["input_ids"].shape, kw["attention_mask"].shape[-1], alive())
            ),
            with_kwargs=True,
        )
        before_prefill: list[int] = []  # bytes alive as each prefill starts
        prefill = generator._prefill

        def counted(*args: Any, **kwargs: Any) -> Any:
            before_prefill.append(alive())
            return prefill(*args, **kwargs)

        monkeypatch.setattr(generator, "_prefill", counted)
        monkeypatch.setattr(kv_cache, "_storage", recorded)
        monkeypatch.setattr(kv_cache, "PREFILL_TOKENS", tokens)
        free = kv_cache.DECODE_HEADROOM + shared + budget
        monkeypatch.setattr(generator, "_free_bytes", lambda: free)
        generator.take_stats()
        chunked = generator.generate(ids, params)
        parked = generator.take_stats()["throughput/decode_parked"]
        hook.remove()
    finally:
        generator.static_cache = False
    prefills = [(rows, positions, keys) for rows, positions, keys, _ in calls if positions > 1]
    assert parked > 0 and len(before_prefill) > 1  # rows were prefilled again
    assert before_prefill == [0] * len(before_prefill)
    assert prefills[:5] == [(5, width, width)] * 4 + [(4, width, width)]  # 24 rows, 5 a call
    assert all(rows * positions <= tokens for rows, positions, _ in prefills)
    assert any(keys > positions for _, positions, keys in prefills)  # a row's later chunk
    assert max(held for *_, held in calls) <= budget
    assert [r.response_token_ids for r in chunked] == [r.response_token_ids for r in whole]
    assert [r.finish_reason for r in chunked] == [r.finish_reason for r in whole]
    for c, w in zip(chunked, whole, strict=True):
        assert c.response_logprobs == pytest.approx(w.response_logprobs, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("sliding", [False, True], ids=["growing-cache", "sliding-windows"])
def test_a_gpu_decode_without_windows_prefills_in_chunks_of_positions(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch, sliding: bool
) -> None:
    """A GPU decode that is not windowed (its model has sliding windows or linear attention:
    transformers' own cache) prefills all its rows in chunks of at most ``PREFILL_TOKENS``
    tokens, each chunk over the keys of the chunks before; so does a prefill again (rows
    whose weights changed mid-decode prefill their decoded tokens too). The samples are
    those of one call, for the embedded model's cache and for a model of sliding windows."""
    ids = _prompt_ids(generator)
    if sliding:
        monkeypatch.setattr(generator, "model", sliding_window_model(generator.model))
    params = SamplingParams(temperature=1.0, max_tokens=24, n=4, seed=3)
    whole = generator.generate(ids, params)
    monkeypatch.setattr(generator, "_chunked_prefill", lambda: True)
    chunked = generate_two_positions_a_call(generator, ids, params, monkeypatch)
    assert [r.response_token_ids for r in chunked] == [r.response_token_ids for r in whole]
    for c, w in zip(chunked, whole, strict=True):
        assert c.response_logprobs == pytest.approx(w.response_logprobs, rel=1e-4, abs=1e-5)


def test_folded_decode_attention_equals_attention_over_repeated_heads() -> None:
    """A decode step's grouped query heads folded into rows of their key/value head give the
    attention over keys and values copied per query head (transformers' way), masked rows
    included."""
    from tandem.attention import folded_decode_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 6, 1, 8, generator=generator)
    key, value = torch.randn(2, 3, 2, 10, 8, generator=generator)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding
    mask[2, ..., 7:] = False
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask
    )
    folded = folded_decode_attention(query, key, value, mask, None)
    assert folded.shape == repeated.shape
    assert torch.allclose(folded, repeated, atol=1e-6)
    unmasked = folded_decode_attention(query, key, value, None, 0.5)
    assert not torch.allclose(unmasked, folded, atol=1e-3)  # the mask did something


class _Recorded:
    """A stand-in for a captured CUDA graph that runs on a CPU: it replays the step as captured
    (same rows, same window; a replay of another shape fails)."""

    def __init__(self, decode: Any) -> None:
        self.decode, self.shape = decode, (len(decode.token), decode.window.length)
        self.logits = decode.forward()

    def replay(self) -> None:
        assert (len(self.decode.token), self.decode.window.length) == self.shape
        self.logits.copy_(self.decode.forward())


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The decode's captures replaced by ``_Recorded`` (with windows of 4 positions): the
    (rows, window) of each, in order."""
    from tandem.generation import static_decode

    shapes: list[tuple[int, int]] = []

    def capture(forward: object) -> tuple[_Recorded, torch.Tensor]:
        graph = _Recorded(forward.__self__)  # type: ignore[attr-defined]
        shapes.append(graph.shape)
        return graph, graph.logits

    monkeypatch.setattr(static_decode, "capture", capture)
    monkeypatch.setattr(static_decode, "CACHE_BUCKET", 4)
    return shapes


def _static_decode(gen: HfGenerator, ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
    """``gen``'s static-cache decode (the GPU's path), run here, eagerly."""
    gen.static_cache = True
    try:
        return gen.generate(ids, params)
    finally:
        gen.static_cache = False


def _graphed(compile_layers: bool) -> HfGenerator:
    """A generator of the embedded model decoding as on a GPU (static cache, CUDA graphs: the
    capture a test's stand-in)."""
    gen = HfGenerator(DEFAULT_MODEL_DIR, compile_layers=compile_layers)
    gen.static_cache = gen.cuda_graphs = True
    return gen


RAGGED = SamplingParams(temperature=4.0, max_tokens=24, n=4, seed=5)
"""Long and ragged samples of the embedded model: windows grow, rows leave."""


def test_the_graphed_decode_captures_once_per_rows_and_window(
    generator: HfGenerator, captures: list[tuple[int, int]]
) -> None:
    """The decode's CUDA-graph bookkeeping, run on the CPU with a stand-in for the capture: a
    captured step replays what it recorded, a new graph comes with each new window and each
    compaction, and the samples are the eager decode's."""
    ids = _prompt_ids(generator)
    generator.static_cache = True
    try:
        eager = generator.generate(ids, RAGGED)
        generator.cuda_graphs = True
        graphed = generator.generate(ids, RAGGED)
    finally:
        generator.static_cache = generator.cuda_graphs = False
    assert len(captures) > 3 and len(set(captures)) == len(captures)  # one per rows x window
    assert len({rows for rows, _ in captures}) > 1  # compactions captured again
    assert len({window for _, window in captures}) > 2  # so did new windows
    assert [r.response_token_ids for r in graphed] == [r.response_token_ids for r in eager]
    for g, e in zip(graphed, eager, strict=True):
        assert g.response_logprobs == pytest.approx(e.response_logprobs, abs=1e-6)


def test_weights_leave_for_the_host_and_come_back_as_the_same_objects(
    generator: HfGenerator,
) -> None:
    """What ``sleep`` does on a GPU (on a CPU it is a no-op: the memory is the host's):
    every storage of the weights emptied, then refilled under the same parameter objects."""
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
    before = generator.generate(ids, params)
    objects = [id(p) for p in generator.model.parameters()]
    generator.sleep()  # on the CPU: nothing moves
    assert not generator.supports_sleep
    assert all(p.untyped_storage().nbytes() for p in generator.model.parameters())
    moved = generator._weights_to_host()
    assert moved.nbytes >= sum(p.numel() * p.element_size() for p in generator.model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in generator.model.parameters())
    generator._asleep = moved  # as sleep() leaves it: generate wakes it first
    again = generator.generate(ids, params)
    assert generator._asleep is None
    assert [id(p) for p in generator.model.parameters()] == objects
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in before]
    assert [r.response_logprobs for r in again] == [r.response_logprobs for r in before]


def test_a_deep_sleep_drops_the_weights_until_a_refit_fills_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sleep_level=2`` (``generation.sleep_level``, a GPU's sleep, made to run on the CPU
    here): the parameters' bytes are dropped, not copied, and only the buffers go to the host;
    after waking, generating before a refit is refused, and a refit gives the samples back."""
    monkeypatch.setattr(HfGenerator, "supports_sleep", property(lambda self: True))
    gen = make_generator(GenerationConfig(backend="hf", sleep_level=2), DEFAULT_MODEL_DIR)
    assert isinstance(gen, HfGenerator) and gen.sleep_level == 2
    ids = _prompt_ids(gen)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
    before = gen.generate(ids, params)
    weights = {name: p.detach().clone() for name, p in gen.model.named_parameters()}
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in gen.model.buffers())
    gen.sleep()
    assert all(p.untyped_storage().nbytes() == 0 for p in gen.model.parameters())
    assert gen._asleep is not None and gen._asleep.nbytes == buffer_bytes > 0
    gen.wake_up()
    assert all(p.untyped_storage().nbytes() for p in gen.model.parameters())
    with pytest.raises(ValueError, match="dropped by a deep sleep"):
        gen.generate(ids, params)
    gen.load_weights(iter(weights.items()))
    again = gen.generate(ids, params)
    assert [r.response_token_ids for r in again] == [r.response_token_ids for r in before]
    assert [r.response_logprobs for r in again] == [r.response_logprobs for r in before]
    gen.sleep()  # a generation without the sleep in between keeps its weights
    gen.load_weights(iter(weights.items()))  # wakes it first
    assert [r.response_token_ids for r in gen.generate(ids, params)] == [
        r.response_token_ids for r in before
    ]


def test_rows_decode_in_even_chunks_with_the_same_samples(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that do not fit one decode run in chunks as even as the bound allows (24 rows at
    most 10 at a time: 8, 8, 8, not 10, 10, 4), and a sample is the same whichever chunk it
    decodes in."""
    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=8, seed=5)
    whole = generator.generate(ids, params)
    rows: list[int] = []

    def record(_module: object, _args: object, kwargs: dict) -> None:
        rows.append(kwargs["input_ids"].shape[0])

    monkeypatch.setattr(generator, "max_batch_size", 10)
    monkeypatch.setattr(hf_generator, "COMPACT_AT", 0.0)  # each chunk keeps its rows
    hook = generator.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        chunked = generator.generate(ids, params)
    finally:
        hook.remove()
    # three decodes of 8 rows, each one prompt's samples: its prompt prefilled once
    assert set(rows) == {1, 8} and rows.count(1) == 3
    assert [r.response_token_ids for r in chunked] == [r.response_token_ids for r in whole]
    assert [r.prompt_index for r in chunked] == [r.prompt_index for r in whole]
    for c, w in zip(chunked, whole, strict=True):
        assert c.response_logprobs == pytest.approx(w.response_logprobs, abs=1e-5)


def test_a_gpu_decode_takes_the_rows_its_free_memory_holds() -> None:
    """The row bound of a GPU decode from the KV cache each row allocates, at Qwen2.5-7B's
    shape (28 layers, 4 key/value heads of 128, bf16: 57,344 bytes a position)."""
    from tandem.assets.real_shapes import real_config
    from tandem.generation.kv_cache import (
        DECODE_HEADROOM,
        decode_rows,
        kv_bytes_per_position,
        row_bytes,
    )

    config = real_config("7b")
    assert kv_bytes_per_position(config, torch.bfloat16) == 28 * 2 * 4 * 128 * 2
    assert kv_bytes_per_position(real_config("0.5b"), torch.float32) == 24 * 2 * 2 * 64 * 4
    each = row_bytes(config, torch.bfloat16, 64, 4096)
    assert each > 57_344 * (64 + 4096)  # and its prefill and logits
    free = 85_017_493_504 - 15_231_233_024  # an H100 80GB less the 7B weights
    fit = (free - DECODE_HEADROOM) // (each * (1 + 1 / 28))
    assert 256 < fit < 300
    assert decode_rows(256, 256, each, 28, free) == 256  # the 4096-token 7B cell: one decode
    assert decode_rows(512, 512, each, 28, free) == 256  # 64 prompts x 8: two of 256
    assert decode_rows(300, 512, each, 28, free) == 150  # two even chunks, not 27x + rest
    assert decode_rows(256, 256, each, 28, None) == 256  # a CPU: the batch bound alone
    assert decode_rows(8, 256, each, 28, each // 2) == 0  # not one row: the caller refuses


def test_no_prompts_generate_nothing(generator: HfGenerator) -> None:
    assert generator.generate([], SamplingParams(max_tokens=4)) == []


def test_the_decode_reports_where_its_time_went(
    generator: HfGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``take_stats``: the seconds of each part of the decode since the last call (together
    the decode's whole time), its steps and the rows it decoded; then nothing until the next."""
    import time

    ids = _prompt_ids(generator)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
    monkeypatch.setattr(hf_generator, "COMPACT_AT", 0.0)  # every row to the end
    generator.take_stats()
    start = time.perf_counter()
    rollouts = generator.generate(ids, params)
    elapsed = time.perf_counter() - start
    stats = generator.take_stats()
    steps = max(len(r.response_token_ids) for r in rollouts)
    assert stats["throughput/decode_steps"] == steps
    assert stats["throughput/decode_row_steps"] == len(rollouts) * steps
    assert stats["throughput/decode_parked"] == 0  # (a CPU's decode has no memory bound)
    assert stats["throughput/decode_prefills"] == 1
    parts = ["prefill", "forward", "sample", "bookkeeping"]
    assert all(stats[f"timing/decode_{part}_s"] > 0 for part in parts[:1] + parts[2:])
    if steps > 1:
        assert stats["timing/decode_forward_s"] > 0
    decode = sum(v for k, v in stats.items() if k.startswith("timing/decode_"))
    assert 0 < decode <= elapsed
    assert generator.take_stats() == {}


def test_a_phase_clock_charges_each_part_its_time() -> None:
    import time

    from tandem.generation.phase_clock import PhaseClock

    clock = PhaseClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.02)
    clock.mark("a")
    time.sleep(0.01)
    clock.mark("b")
    time.sleep(0.02)
    clock.mark("a")
    seconds = clock.seconds()
    assert set(seconds) == {"a", "b"}
    assert 0.04 <= seconds["a"] < 0.5 and 0.01 <= seconds["b"] < 0.25


@pytest.mark.xdist_group("inductor")  # one worker, one after another: Inductor compiles once
def test_compiled_layers_decode_the_same_samples_and_compile_once_for_every_layer(
    generator: HfGenerator, captures: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generation.compile``: the static decode through compiled decoder layers (Inductor on
    the CPU here) gives the eager decode's tokens and logprobs (fp32, within 1e-5). The layers
    share their compiled code (not one compilation a layer: fewer graphs than layers); a
    second decode, with other windows and batch sizes, compiles nothing more; and each captured
    step (the stand-in of the test above) ran eagerly at its shape first, so that no
    compilation can happen inside a capture."""
    from torch._dynamo.utils import counters

    from tandem.generation import static_decode

    eager_shapes: list[tuple[int, int]] = []
    forward, stand_in = static_decode.StaticDecode.forward, static_decode.capture

    def recorded(self: static_decode.StaticDecode) -> torch.Tensor:
        eager_shapes.append((len(self.token), self.window.length))
        return forward(self)

    def capture(step: Any) -> tuple[Any, torch.Tensor]:
        shape = (len(step.__self__.token), step.__self__.window.length)
        if shape not in eager_shapes:
            unwarmed.append(shape)
        return stand_in(step)

    unwarmed: list[tuple[int, int]] = []
    monkeypatch.setattr(static_decode.StaticDecode, "forward", recorded)
    monkeypatch.setattr(static_decode, "capture", capture)
    ids = _prompt_ids(generator)
    eager = _static_decode(generator, ids, RAGGED)
    compiled = _graphed(compile_layers=True)
    try:
        graphs = counters["stats"]["unique_graphs"]
        first = compiled.generate(ids, RAGGED)
        again = counters["stats"]["unique_graphs"]
        graphs = again - graphs
        longer = SamplingParams(temperature=4.0, max_tokens=30, n=3, seed=9)
        other = compiled.generate(ids[:2], longer)
        assert counters["stats"]["unique_graphs"] == again  # nothing compiled again
    finally:
        torch._dynamo.reset()
    layers = compiled.model.config.num_hidden_layers
    assert 0 < graphs < layers * 4  # 4 pieces a layer (the cache's update breaks them)
    assert captures and not unwarmed and compiled.cuda_graphs
    assert len(other) == 6 and max(len(r.response_token_ids) for r in other) > 12
    assert [r.response_token_ids for r in first] == [r.response_token_ids for r in eager]
    for c, e in zip(first, eager, strict=True):  # (fused fp32 sums in another order)
        assert c.response_logprobs == pytest.approx(e.response_logprobs, rel=1e-5, abs=1e-5)


@pytest.mark.xdist_group("inductor")  # one worker, one after another: Inductor compiles once
@pytest.mark.parametrize("compile_layers", [True, False])
def test_a_failed_capture_drops_the_compiled_layers_before_the_graphs(
    generator: HfGenerator,
    captures: list[tuple[int, int]],
    compile_layers: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capture that fails (``static_decode.capture`` returns None): with compiled layers the
    generator drops them and goes on capturing over the eager layers; without, it decodes
    without graphs from then on. Either way the decode gives the eager decode's samples."""
    from tandem.generation import static_decode
    from tandem.trainer.parallelize import decoder_layers

    stand_in, failed = static_decode.capture, []

    def fails_once(step: Any) -> Any:
        if not failed:
            failed.append(True)
            return None
        return stand_in(step)

    monkeypatch.setattr(static_decode, "capture", fails_once)
    ids = _prompt_ids(generator)
    eager = _static_decode(generator, ids, RAGGED)
    tried = _graphed(compile_layers)
    try:
        got = tried.generate(ids, RAGGED)
    finally:
        torch._dynamo.reset()
    assert failed
    assert tried.cuda_graphs == compile_layers and bool(captures) == compile_layers
    assert not tried._compiled
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(tried.model))
    assert [r.response_token_ids for r in got] == [r.response_token_ids for r in eager]
    for g, e in zip(got, eager, strict=True):
        assert g.response_logprobs == pytest.approx(e.response_logprobs, rel=1e-5, abs=1e-5)
