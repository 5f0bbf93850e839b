"""Vision-language models written without a download: a tiny Qwen2.5-VL (the embedded visual
model) and random models of Qwen2.5-VL's real shapes (benchmarks), each with its image
processor and a tokenizer that knows the vision tokens.

The tiny model's tokenizer is the embedded byte tokenizer (id = byte, 256 = ``<|endoftext|>``)
plus Qwen2-VL's four vision tokens at 257-260; the real-shape one is ``real_shapes``' tokenizer
of the real vocabulary, whose special ids after ``<|endoftext|>`` stand in for the vision tokens
at Qwen2.5-VL's own ids. Prompts are built from the ids in the model's config
(``data.images.VisionProcessor``), so neither needs a chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision tokens, in the order the tiny tokenizer gives them ids (257-260)."""

TINY_TEXT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
)
"""The tiny model's language model (about 0.1M parameters besides the embedding)."""
TINY_VISION: dict[str, Any] = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    patch_size=8,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=32,
    fullatt_block_indexes=[1],
)
"""The tiny model's vision tower: 8-pixel patches merged 2x2, so a 48x48 image is 9 tokens."""
TINY_IMAGE_PIXELS = (16 * 16, 64 * 64)
"""(min, max) pixels the tiny model's image processor resizes images into."""

QWEN25_VL_VISION: dict[str, Any] = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)
"""The vision tower of every Qwen2.5-VL (3B/7B/32B/72B; its out_hidden_size is the LM's)."""
QWEN25_VL_IDS = dict(
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    image_token_id=151655,
    video_token_id=151656,
)
"""Qwen2.5-VL's vision token ids (special ids after ``<|endoftext|>`` = 151643)."""


def image_processor(patch_size: int, merge_size: int, pixels: tuple[int, int]) -> Any:
    """transformers' Qwen2-VL image processor (its PIL backend where torchvision is absent)."""
    import transformers

    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or (
        transformers.Qwen2VLImageProcessor
    )
    return cls(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=2,
        min_pixels=pixels[0],
        max_pixels=pixels[1],
    )


def tiny_tokenizer() -> Any:
    """The embedded byte tokenizer with the vision tokens added (a transformers tokenizer)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from tandem.assets import DEFAULT_MODEL_DIR

    raw = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tokenizer = transformers.Qwen2Tokenizer(
        tokenizer_object=raw,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,  # type: ignore[arg-type]  # the byte tokenizer has no unknown token
    )
    tokenizer.model_max_length = TINY_TEXT["max_position_embeddings"]
    return tokenizer


def _vl_config(text: dict[str, Any], vision: dict[str, Any], ids: dict[str, int]) -> Any:
    import transformers

    vision = vision | {"out_hidden_size": text["hidden_size"]}
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"]
    )
    for key, value in ids.items():
        setattr(config, key, value)
    return config


def _write(
    path: Path, config: Any, tokenizer: Any, processor: Any, dtype: str, device: str = "cpu"
) -> Path:
    """The model folder at ``path`` (written under a temporary name, then renamed: a folder
    that exists is complete), initialised with seed 0 on ``device``."""
    import torch
    import transformers

    from tandem.tensors.devices import release_device_caches

    # resolved outside the device context (a lazily imported module's tensors would land there)
    model_class = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config).to(getattr(torch, dtype))
    eos = int(config.text_config.eos_token_id)
    model.generation_config.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    partial = path.with_name(path.name + ".partial")
    model.save_pretrained(partial)
    processor.save_pretrained(partial)
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    partial.rename(path)
    del model
    release_device_caches()  # initialised on a GPU: its blocks back, not kept by this process
    return path


def write_tiny_qwen2_vl(path: Path) -> Path:
    """A Hugging Face folder at ``path`` (kept if it exists) holding a randomly initialised
    fp32 tiny Qwen2.5-VL (``TINY_TEXT`` + ``TINY_VISION``, ~0.2M parameters, under 1 MB) with
    its image processor and the byte tokenizer plus the vision tokens."""
    if (path / "config.json").exists():
        return path
    tokenizer = tiny_tokenizer()
    ids = {
        "vision_start_token_id": tokenizer.convert_tokens_to_ids(VISION_TOKENS[0]),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids(VISION_TOKENS[1]),
        "image_token_id": tokenizer.convert_tokens_to_ids(VISION_TOKENS[2]),
        "video_token_id": tokenizer.convert_tokens_to_ids(VISION_TOKENS[3]),
    }
    eos = tokenizer.eos_token_id
    text = TINY_TEXT | {
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
    }
    config = _vl_config(text, TINY_VISION, ids)
    processor = image_processor(8, 2, TINY_IMAGE_PIXELS)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write(path, config, tokenizer, processor, "float32")


def write_real_shape_vl(
    path: Path,
    shape: str = "3b",
    num_layers: int | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
) -> Path:
    """A random Qwen2.5-VL-``shape`` folder at ``path`` (kept if it exists): the Qwen2.5
    language model of that shape (``real_shapes.real_config``) with Qwen2.5-VL's vision tower
    (``num_layers`` overrides both depths, for a cheaper model of the real width; ``device``
    "cuda" initialises on the GPU), its image
    processor (14-pixel patches) and the real-vocabulary tokenizer."""
    from tandem.assets.real_shapes import EOS_ID, real_config, write_tokenizer

    if (path / "config.json").exists():
        return path
    base = real_config(shape, num_layers)
    text = {
        key: getattr(base, key)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "tie_word_embeddings",
            "max_position_embeddings",
        )
    }
    text |= {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [16, 24, 24],
        },
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
    }
    vision = QWEN25_VL_VISION | (
        {} if num_layers is None else {"depth": num_layers, "fullatt_block_indexes": [0]}
    )
    config = _vl_config(text, vision, QWEN25_VL_IDS)
    processor = image_processor(14, 2, (56 * 56, 28 * 28 * 1280))
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, config, None, processor, dtype, device)
    write_tokenizer(path)
    return path
