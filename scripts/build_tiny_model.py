"""Build the embedded tiny model: a byte-level BPE tokenizer and a small Qwen2 config + weights.

Writes a standard Hugging Face folder (default: ``src/tandem/assets/tiny-qwen2/``) that
transformers, the tokenizers library and vLLM all load. The weights are a seeded random
initialisation; the SFT warm start later overwrites ``model.safetensors`` in the same folder
(``--skip-weights`` refreshes config and tokenizer without touching trained weights).

The tokenizer is byte-level BPE with no merges: id ``b`` is byte ``b`` (0..255), id 256 is
``<|endoftext|>`` (EOS and pad). Its pipeline (NFC, the Qwen2 split regex, ByteLevel) is the one
transformers' ``Qwen2Tokenizer`` rebuilds when it loads a qwen2 folder, so every loader
(``AutoTokenizer``, ``tokenizers.Tokenizer.from_file``, vLLM) produces the same ids.

Usage: ``python scripts/build_tiny_model.py [--out DIR] [--seed 0] [--skip-weights]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from tandem.assets.real_shapes import EOS_TOKEN, QWEN2_SPLIT_REGEX, byte_to_unicode

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "tandem" / "assets" / "tiny-qwen2"


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges; token id == byte value, then the special token."""
    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    assert tokenizer.token_to_id(EOS_TOKEN) == 256
    return tokenizer


def model_config(vocab_size: int, eos_id: int) -> dict[str, object]:
    """~0.8M parameters; head_dim 32 because vLLM's CPU attention needs head_dim >= 32."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
    }


def write_tokenizer(out: Path) -> int:
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 256,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(eos_id): {
                "content": EOS_TOKEN,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return eos_id


def write_model(out: Path, vocab_size: int, eos_id: int, seed: int, weights: bool) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config_dict = model_config(vocab_size, eos_id)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if not weights:
        return
    torch.manual_seed(seed)
    config = Qwen2Config.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # save_pretrained rewrites config.json in transformers' own layout; the one above stays the
    # source of truth for the hyperparameters.
    model.save_pretrained(out, safe_serialization=True)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({num_params / 1e6:.2f}M parameters, seed {seed})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip-weights", action="store_true", help="keep model.safetensors (e.g. trained ones)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    eos_id = write_tokenizer(args.out)
    vocab_size = eos_id + 1
    write_model(args.out, vocab_size, eos_id, args.seed, weights=not args.skip_weights)


if __name__ == "__main__":
    main()
