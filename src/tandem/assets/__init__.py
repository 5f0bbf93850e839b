"""Assets shipped inside the package: the embedded tiny model and its tokenizer, and random
models of any Qwen2 shape that share that tokenizer (benchmarks, GPU tests, smoke runs)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ASSETS_DIR = Path(__file__).parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "tiny-qwen2"
"""The embedded default model (Hugging Face folder, warm-started on the arithmetic task)."""


def write_random_qwen2(
    path: Path, shape: dict[str, Any], device: str = "cpu", seed: int = 0
) -> Path:
    """A Hugging Face folder at ``path`` (kept if it exists) holding a randomly initialised fp32
    Qwen2 of ``shape`` with the embedded model's tokenizer (vocabulary 257, tied embeddings
    unless ``shape`` says otherwise): a model of a real size that every backend can load,
    generate from and decode."""
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    config = transformers.Qwen2Config(
        **{"vocab_size": 257, "tie_word_embeddings": True, "max_position_embeddings": 4096}
        | dict(shape)
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 256
    # Resolved outside the device context: transformers imports its modeling modules lazily, and
    # a module-level tensor built during that import (torchaudio's EPSILON) would land on the GPU.
    model_class = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config)
    model.save_pretrained(path)
    for item in DEFAULT_MODEL_DIR.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy2(item, path / item.name)
    return path


VISUAL_MODEL_DIR = ASSETS_DIR / "tiny-qwen2.5-vl"
"""The embedded vision-language model (a tiny Qwen2.5-VL written by
``assets.vision.write_tiny_qwen2_vl``, warm-started on the visual task)."""


def embedded_path(value: Any) -> Any:
    """``embedded:NAME`` as the embedded model folder ``NAME`` (config values name embedded
    models so); anything else as it is."""
    if isinstance(value, str) and value.startswith("embedded:"):
        path = ASSETS_DIR / value.removeprefix("embedded:")
        if not (path / "config.json").is_file():
            names = sorted(p.name for p in ASSETS_DIR.iterdir() if (p / "config.json").is_file())
            raise ValueError(f"no embedded model {value!r} (embedded: {', '.join(names)})")
        return path
    return value
