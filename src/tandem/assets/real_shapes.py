"""Random models of the real Qwen2.5 shapes with a tokenizer of the real vocabulary size.

Benchmarks and GPU tests pay the real costs of the LM head (151,936 rows), of sampling over the
whole vocabulary and of the logprob pass without downloading a model: ``write_real_shape``
writes a Hugging Face folder with a randomly initialised Qwen2 of the 0.5B / 1.5B / 3B / 7B
layout (tied embeddings where the real model ties them) and a byte-level BPE tokenizer of
exactly ``QWEN25_VOCAB_SIZE`` ids in which every id decodes.

A random model's next-token distribution is almost uniform over 151,936 ids, so it would stop
only at the token cap. ``mean_length`` scales the EOS row of the LM head so that a response
ends after about that many tokens on average (geometric-like: lengths spread from tens of
tokens to the cap), which is what exercises rows that finish early.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

QWEN25_VOCAB_SIZE = 151_936
"""The vocabulary (embedding rows) of every Qwen2.5 and Qwen3 dense model."""
EOS_ID = 151_643
"""``<|endoftext|>``'s id in Qwen2.5's tokenizer; the ids after it are special tokens."""
EOS_TOKEN = "<|endoftext|>"
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""The split regex of transformers' ``Qwen2Tokenizer``: matching it keeps ``AutoTokenizer``
(which rebuilds the pipeline for qwen2 folders) and the raw tokenizer.json in agreement."""

QWEN25_SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}
"""The layer shapes of Qwen2.5-0.5B/1.5B/3B/7B (their config.json files); all use rope theta
1e6, RMSNorm eps 1e-6, SiLU MLPs and biases on q/k/v."""


def byte_to_unicode() -> dict[int, str]:
    """The printable-character alias of each byte used by byte-level BPE (GPT-2's scheme)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _merges(count: int) -> tuple[list[str], list[tuple[str, str]]]:
    """``count`` merges over the 256 byte tokens, each making a new token from two existing
    ones: every byte pair first (65,536 two-byte tokens), then two-byte tokens extended by a
    byte. Returns the new tokens (in id order) and the merges."""
    chars = [byte_to_unicode()[b] for b in range(256)]
    tokens: list[str] = []
    merges: list[tuple[str, str]] = []
    for first in chars:
        for second in chars:
            if len(merges) == count:
                return tokens, merges
            tokens.append(first + second)
            merges.append((first, second))
    pairs = list(tokens)
    for pair in pairs:
        for last in chars:
            if len(merges) == count:
                return tokens, merges
            tokens.append(pair + last)
            merges.append((pair, last))
    raise ValueError(f"at most {len(merges)} merges over 256 bytes up to three bytes")


def build_tokenizer(vocab_size: int = QWEN25_VOCAB_SIZE, eos_id: int = EOS_ID) -> Any:
    """Byte-level BPE of exactly ``vocab_size`` ids: bytes 0..255, merged tokens up to
    ``eos_id``, ``<|endoftext|>`` at ``eos_id``, special ``<|reserved_N|>`` tokens after it.
    Every id decodes (a merged token to its bytes, a special token to its text or nothing)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if not 256 <= eos_id < vocab_size:
        raise ValueError(f"need 256 <= eos_id < vocab_size, got {eos_id} and {vocab_size}")
    merged, merges = _merges(eos_id - 256)
    byte_chars = [byte_to_unicode()[b] for b in range(256)]
    vocab = {token: index for index, token in enumerate(byte_chars + merged)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    special = [EOS_TOKEN] + [f"<|reserved_{i}|>" for i in range(vocab_size - eos_id - 1)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    assert tokenizer.get_vocab_size() == vocab_size and tokenizer.token_to_id(EOS_TOKEN) == eos_id
    return tokenizer


def write_tokenizer(path: Path, vocab_size: int = QWEN25_VOCAB_SIZE, eos_id: int = EOS_ID) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``path``."""
    tokenizer = build_tokenizer(vocab_size, eos_id)
    tokenizer.save(str(path / "tokenizer.json"))
    added = {
        str(eos_id + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(
            [EOS_TOKEN] + [f"<|reserved_{i}|>" for i in range(vocab_size - eos_id - 1)]
        )
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def real_config(shape: str, num_layers: int | None = None) -> Any:
    """The ``transformers.Qwen2Config`` of Qwen2.5-``shape`` (``num_layers`` overrides the
    depth, for tests that want the real width at less cost)."""
    import transformers

    if shape not in QWEN25_SHAPES:
        raise ValueError(f"shape must be one of {sorted(QWEN25_SHAPES)}, got {shape!r}")
    layers = {} if num_layers is None else {"num_hidden_layers": num_layers}
    config = transformers.Qwen2Config(
        vocab_size=QWEN25_VOCAB_SIZE,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        **(QWEN25_SHAPES[shape] | layers),
    )
    # no pad_token_id in the model config, as in Qwen2.5's: the embedding's padding row would be
    # zero (a constant EOS logit that no scale moves); the tokenizer and generation config pad
    config.bos_token_id = config.eos_token_id = EOS_ID
    return config


def eos_scale(hidden: Any, head: Any, eos_id: int, mean_length: float) -> float:
    """The factor on the LM head's EOS row that makes EOS's mean probability over the sampled
    positions ``hidden`` ``[N, H]`` (final-norm outputs) about ``1 / mean_length``: bisection on
    the log of the factor (the mean probability grows with it)."""
    import torch

    with torch.no_grad():
        logits = hidden.float() @ head.float().T
        eos_logit = logits[:, eos_id].clone()
        logits[:, eos_id] = float("-inf")
        rest = torch.logsumexp(logits, dim=-1)
    target = 1.0 / mean_length

    def mean_probability(scale: float) -> float:
        return float(torch.sigmoid(scale * eos_logit - rest).mean())

    low, high = 0.0, math.log(1e4)
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if mean_probability(math.exp(middle)) < target else (low, middle)
    return math.exp((low + high) / 2)


def _spread_lengths(model: Any, mean_length: float, seed: int) -> float:
    """Scale the EOS row of ``model``'s LM head (``eos_scale`` on hidden states of random
    tokens); returns the factor. A tied head scales the EOS embedding with it, which only
    padding and the final token of a response read."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOS_ID, (4, 64), generator=generator)
    device = model.get_output_embeddings().weight.device
    with torch.no_grad():
        hidden = model.model(input_ids=tokens.to(device)).last_hidden_state.flatten(0, 1)
        head = model.get_output_embeddings().weight
        scale = eos_scale(hidden, head, EOS_ID, mean_length)
        head[EOS_ID] *= scale
    return scale


def write_real_shape(
    path: Path,
    shape: str,
    mean_length: float | None = None,
    num_layers: int | None = None,
    device: str = "cpu",
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """A Hugging Face folder at ``path`` (kept if it exists) with a random Qwen2.5-``shape``
    model (``real_config``) in ``dtype`` and the real-vocabulary tokenizer. ``mean_length``
    spreads response lengths (see the module docstring); ``device="cuda"`` initialises on the
    GPU (a 7B model in minutes rather than an hour of CPU)."""
    import torch
    import transformers

    from tandem.tensors.devices import release_device_caches

    if (path / "config.json").exists():
        return path
    config = real_config(shape, num_layers)
    model_class = transformers.Qwen2ForCausalLM  # resolved outside the device context
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config).to(getattr(torch, dtype))
    scale = None if mean_length is None else _spread_lengths(model, mean_length, seed)
    partial = path.with_name(path.name + ".partial")
    model.generation_config.pad_token_id = EOS_ID
    model.save_pretrained(partial)
    write_tokenizer(partial)
    note = {"shape": shape, "num_layers": config.num_hidden_layers, "mean_length": mean_length}
    (partial / "random_model.json").write_text(json.dumps(note | {"eos_scale": scale}) + "\n")
    partial.rename(path)  # a folder that exists is complete
    del model
    release_device_caches()  # initialised on a GPU: its blocks back, not kept by this process
    return path


def real_shape_dir(shape: str, mean_length: float | None = None, layers: int | None = None) -> str:
    """The folder name ``write_real_shape`` output is cached under for these settings."""
    spread = "" if mean_length is None else f"-len{int(mean_length)}"
    depth = "" if layers is None else f"-{layers}l"
    return f"qwen2.5-{shape}-random{depth}{spread}"


def cached_real_shape(
    shape: str,
    mean_length: float | None = None,
    num_layers: int | None = None,
    device: str = "cpu",
    root: Path | None = None,
) -> Path:
    """``write_real_shape`` into the cache folder (``root``, else ``$TANDEM_CACHE``, else
    ``~/.cache/tandem``), once per setting."""
    import os

    base = root or Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    path = base / "models" / real_shape_dir(shape, mean_length, num_layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_real_shape(path, shape, mean_length, num_layers, device=device)
