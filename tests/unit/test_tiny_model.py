import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.assets import DEFAULT_MODEL_DIR

TEXTS = [
    "17+25=42",
    "  two  spaces\nnewline\n\ttab ",
    "Question: 12*3?\n#### -36",
    "0123456789",
    "héllo ✓ 数学",
]


@pytest.fixture(scope="module")
def tokenizers_pair() -> tuple[object, Tokenizer]:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR), Tokenizer.from_file(
        str(DEFAULT_MODEL_DIR / "tokenizer.json")
    )


@pytest.mark.parametrize("text", TEXTS)
def test_autotokenizer_and_raw_tokenizer_agree_and_round_trip(
    tokenizers_pair: tuple[object, Tokenizer], text: str
) -> None:
    auto, raw = tokenizers_pair
    auto_ids = auto.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    raw_ids = raw.encode(text, add_special_tokens=False).ids
    assert auto_ids == raw_ids
    assert auto.decode(auto_ids) == text  # type: ignore[attr-defined]
    assert raw.decode(raw_ids) == text


def test_tokens_are_bytes_and_eos_is_special(tokenizers_pair: tuple[object, Tokenizer]) -> None:
    auto, _ = tokenizers_pair
    assert auto.encode("17+25=", add_special_tokens=False) == list(b"17+25=")  # type: ignore[attr-defined]
    eos = auto.eos_token_id  # type: ignore[attr-defined]
    assert eos == auto.pad_token_id == 256  # type: ignore[attr-defined]
    assert auto.encode("42<|endoftext|>", add_special_tokens=False) == [52, 50, eos]  # type: ignore[attr-defined]
    assert auto.decode([52, 50, eos], skip_special_tokens=True) == "42"  # type: ignore[attr-defined]


def test_model_loads_and_fits_vllm_constraints() -> None:
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU attention
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
    num_params = sum(p.numel() for p in model.parameters())
    assert 3e5 < num_params < 2e6
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR))
    assert next(model.parameters()).dtype == torch.float32
    logits = model(torch.tensor([list(b"17+25=")])).logits
    assert logits.shape == (1, 6, config["vocab_size"])
    assert torch.isfinite(logits).all()
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir())
    assert size < 8 * 2**20
