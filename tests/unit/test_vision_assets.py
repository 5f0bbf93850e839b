"""The embedded vision-language model: written without a download, small, its tokenizer the
embedded byte tokenizer plus the vision tokens, its processor and weights loading through
transformers' own classes, and its outputs depending on the image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.assets import DEFAULT_MODEL_DIR, VISUAL_MODEL_DIR
from tandem.assets.vision import VISION_TOKENS, write_tiny_qwen2_vl
from tandem.data.images import VisionProcessor
from tandem.data.visual import Scene


def _config(path: Path) -> dict[str, object]:
    config = json.loads((path / "config.json").read_text())
    config.pop("transformers_version", None)
    return dict(config)


def test_the_writer_gives_the_shipped_layout_in_under_2_mb(tmp_path: Path) -> None:
    folder = write_tiny_qwen2_vl(tmp_path / "vl")
    assert _config(folder) == _config(VISUAL_MODEL_DIR)
    assert json.loads((folder / "preprocessor_config.json").read_text()) == json.loads(
        (VISUAL_MODEL_DIR / "preprocessor_config.json").read_text()
    )
    sizes = {p.name: p.stat().st_size for p in VISUAL_MODEL_DIR.iterdir()}
    assert sum(sizes.values()) < 2 * 1024 * 1024, sizes
    assert "vision_config" in _config(folder)


def test_the_tokenizer_is_the_byte_tokenizer_plus_the_vision_tokens() -> None:
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    vision = AutoTokenizer.from_pretrained(str(VISUAL_MODEL_DIR))
    sample = "How many shapes? 3\n  12+7=19 é"
    assert vision.encode(sample) == text.encode(sample) == list(sample.encode())
    assert [vision.convert_tokens_to_ids(t) for t in VISION_TOKENS] == [257, 258, 259, 260]
    assert vision.eos_token_id == text.eos_token_id == 256
    assert vision.decode([257, 104, 105, 259, 256], skip_special_tokens=True) == "hi"
    config = _config(VISUAL_MODEL_DIR)
    assert config["image_token_id"] == 259 and config["vision_start_token_id"] == 257


def test_the_processor_expands_one_pad_token_per_merged_patch() -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    assert (
        "Qwen2VLImageProcessor"
        in type(AutoImageProcessor.from_pretrained(VISUAL_MODEL_DIR)).__name__
    )
    processor = VisionProcessor(VISUAL_MODEL_DIR, AutoTokenizer.from_pretrained(VISUAL_MODEL_DIR))
    image = Scene(((0, "circle"),), "red").draw()
    prompt = processor("count?", [image, image])
    grid = prompt.images.image_grid_thw
    assert grid.tolist() == [[1, 6, 6], [1, 6, 6]]  # 48 px / 8 px patches
    assert prompt.count(259) == 2 * 9  # 6x6 patches merged 2x2, per image
    assert prompt[:1] == [257] and prompt[10] == 258 and prompt[-6:] == list(b"count?")
    assert prompt.images.pixel_values.shape == (2 * 36, 3 * 2 * 8 * 8)


def test_the_model_reads_the_pixels() -> None:
    """Two images under the same text give different next-token distributions (the vision
    tower's outputs reach the language model); the same image gives the same."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(VISUAL_MODEL_DIR).eval()
    processor = VisionProcessor(VISUAL_MODEL_DIR, AutoTokenizer.from_pretrained(VISUAL_MODEL_DIR))

    def last_logits(scene: Scene) -> torch.Tensor:
        prompt = processor("count?", [scene.draw()])
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor([list(prompt)]),
                pixel_values=prompt.images.pixel_values,
                image_grid_thw=prompt.images.image_grid_thw,
            )
        return out.logits[0, -1]

    blue = Scene(((4, "square"),), "blue")
    red = Scene(((4, "square"),), "red")
    assert torch.equal(last_logits(blue), last_logits(blue))
    assert (last_logits(blue) - last_logits(red)).abs().max() > 1e-4


def test_an_unknown_embedded_name_is_refused() -> None:
    from tandem.config.models import PolicyConfig

    assert PolicyConfig(model_path="embedded:tiny-qwen2.5-vl").model_path == VISUAL_MODEL_DIR
    with pytest.raises(ValueError, match="no embedded model 'embedded:nope'"):
        PolicyConfig(model_path="embedded:nope")
