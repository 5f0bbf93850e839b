"""Random models of the real Qwen2.5 shapes with the real vocabulary (``assets.real_shapes``)."""

from pathlib import Path

import pytest
import torch

from tandem.assets.real_shapes import (
    EOS_ID,
    QWEN25_SHAPES,
    QWEN25_VOCAB_SIZE,
    eos_scale,
    real_config,
    write_real_shape,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the real 0.5B width and vocabulary, two layers
    path = tmp_path_factory.mktemp("real") / "qwen2.5-0.5b-2l"
    return write_real_shape(path, "0.5b", mean_length=64, num_layers=2, dtype="float32")


def test_the_tokenizer_has_the_real_size_every_id_decodes_and_loaders_agree(
    model_dir: Path,
) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert len(auto) == raw.get_vocab_size() == QWEN25_VOCAB_SIZE
    assert auto.eos_token_id == auto.pad_token_id == EOS_ID
    text = "Solve 12 + 30 =\n  Ünïcode, 'quotes' and\ttabs <|endoftext|> 7"
    assert auto(text)["input_ids"] == raw.encode(text).ids
    assert raw.encode(text).ids[-3] == EOS_ID  # the special token is one id
    assert auto.decode(raw.encode(text).ids) == text
    decoded = auto.batch_decode([[i] for i in range(QWEN25_VOCAB_SIZE)])  # none raises
    assert len(decoded) == QWEN25_VOCAB_SIZE and decoded[EOS_ID] == "<|endoftext|>"


@pytest.mark.parametrize("shape", sorted(QWEN25_SHAPES))
def test_configs_have_the_real_shapes(shape: str) -> None:
    config = real_config(shape)
    real = {  # hidden, layers, heads, kv heads, intermediate, tied (the published configs)
        "0.5b": (896, 24, 14, 2, 4864, True),
        "1.5b": (1536, 28, 12, 2, 8960, True),
        "3b": (2048, 36, 16, 2, 11008, True),
        "7b": (3584, 28, 28, 4, 18944, False),
    }[shape]
    got = (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.tie_word_embeddings,
    )
    assert got == real
    assert config.vocab_size == QWEN25_VOCAB_SIZE and config.eos_token_id == EOS_ID
    assert config.pad_token_id is None  # no zeroed padding row in the embedding
    with pytest.raises(ValueError, match="shape must be one of"):
        real_config("2b")


def test_the_eos_scale_gives_the_asked_mean_probability() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 32, generator=generator)
    head = torch.randn(1000, 32, generator=generator) * 0.1
    scale = eos_scale(hidden, head, 7, mean_length=50)
    logits = hidden @ head.T
    logits[:, 7] *= scale
    assert torch.softmax(logits, -1)[:, 7].mean().item() == pytest.approx(1 / 50, rel=1e-3)


def test_a_random_policy_stops_at_spread_lengths(model_dir: Path) -> None:
    from tandem.generation.base import SamplingParams
    from tandem.generation.hf_generator import HfGenerator

    generator = HfGenerator(model_dir)
    prompts = [generator.tokenizer.encode(p) for p in ("Solve 3 + 4 =", "What is 12 * 9?")]
    rollouts = generator.generate(prompts, SamplingParams(n=12, max_tokens=160, seed=0))
    lengths = sorted(len(r.response_token_ids) for r in rollouts)
    stopped = sum(r.finish_reason == "stop" for r in rollouts)
    assert 6 <= stopped < len(rollouts) or lengths[0] < 40 < lengths[-1]
    assert lengths[-1] - lengths[0] >= 60, lengths  # from short to long in one batch


def test_finished_rows_leave_the_windowed_static_decode_at_the_real_vocabulary(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's decode path (static cache read in windows; graphs aside) on the real 0.5B
    width and vocabulary with spread lengths: the batch shrinks as rows finish, and the samples
    are those of a decode that keeps every row and reads the whole cache every step."""
    from tandem.generation import hf_generator, static_decode
    from tandem.generation.base import SamplingParams
    from tandem.generation.hf_generator import HfGenerator

    generator = HfGenerator(model_dir)
    generator.static_cache = True
    prompts = [generator.tokenizer.encode(p) for p in ("Solve 3 + 4 =", "What is 12 * 9?")]
    params = SamplingParams(n=4, max_tokens=48, seed=1)
    rows: list[int] = []

    def record(_module: object, _args: object, kwargs: dict) -> None:
        rows.append(kwargs["input_ids"].shape[0])

    generator.model.register_forward_pre_hook(record, with_kwargs=True)
    monkeypatch.setattr(static_decode, "CACHE_BUCKET", 32)
    compacted = generator.generate(prompts, params)
    compacted_rows, rows[:] = list(rows), []
    monkeypatch.setattr(static_decode, "CACHE_BUCKET", 1 << 20)
    monkeypatch.setattr(hf_generator, "COMPACT_AT", 0.0)
    whole = generator.generate(prompts, params)
    lengths = sorted(len(r.response_token_ids) for r in whole)
    assert lengths[0] < 8 and lengths[-1] == 48, lengths  # spread
    assert set(rows) == {8}
    assert compacted_rows[0] == 8 and compacted_rows == sorted(compacted_rows, reverse=True)
    assert sum(compacted_rows) < 0.8 * sum(rows)  # finished rows stopped computing
    assert [r.response_token_ids for r in compacted] == [r.response_token_ids for r in whole]
    for c, w in zip(compacted, whole, strict=True):
        assert c.response_logprobs == pytest.approx(w.response_logprobs, abs=1e-5)
