"""Image prompts as the vLLM generator sends them, with no engine: the images rebuilt from the
trainer's patches give the processor back the same patches, each image's ``<|image_pad|>`` run
collapses to the one placeholder vLLM expands itself, and a vision-language model is refused
where torchvision does not import."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tandem.assets import DEFAULT_MODEL_DIR, VISUAL_MODEL_DIR
from tandem.data.images import ImagePrompt, VisionProcessor, own_prompt, patch_images
from tandem.data.prompts import load_tokenizer
from tandem.data.visual import QUESTION, scenes
from tandem.generation.vllm_generator import VllmImages


@pytest.fixture(scope="module")
def processor() -> VisionProcessor:
    return VisionProcessor(VISUAL_MODEL_DIR, load_tokenizer(VISUAL_MODEL_DIR))


def _pictures() -> list[Image.Image]:
    """A task image, an odd-sized one (61x37: resized to a multiple of the merged patch) and
    random pixels (every byte value a round trip could get wrong)."""
    noise = torch.randint(0, 256, (40, 72, 3), generator=torch.Generator().manual_seed(0))
    scene = scenes(1, 0, held_out=False)[0].draw()
    return [scene, scene.resize((61, 37)), Image.fromarray(noise.to(torch.uint8).numpy())]


@pytest.mark.parametrize("which", [[0], [1], [2], [0, 1, 2]])
def test_patch_images_give_the_processor_back_the_same_patches(
    processor: VisionProcessor, which: list[int]
) -> None:
    prompt = processor(QUESTION, [_pictures()[i] for i in which])
    images = patch_images(prompt.images, processor.image_processor)
    grid = prompt.images.image_grid_thw
    patch = processor.image_processor.patch_size
    assert [im.size for im in images] == [(w * patch, h * patch) for _, h, w in grid.tolist()]
    again = processor.image_processor(images=images, return_tensors="pt")
    assert torch.equal(again["image_grid_thw"], grid)
    assert torch.equal(again["pixel_values"].float(), prompt.images.pixel_values)


def test_the_odd_sized_image_was_resized(processor: VisionProcessor) -> None:
    """The 61x37 case above tests a resized image (its patches are not of the original)."""
    prompt = processor(QUESTION, [_pictures()[1]])
    _, h, w = prompt.images.image_grid_thw.tolist()[0]
    patch = processor.image_processor.patch_size
    assert (w * patch, h * patch) != (61, 37)


def test_a_request_holds_one_image_pad_per_image(processor: VisionProcessor) -> None:
    pictures = _pictures()
    prompt = processor(QUESTION, pictures)
    vision = VllmImages(VISUAL_MODEL_DIR)
    pad = vision.image_token_id
    assert pad == processor.image_token_id and prompt.count(pad) > 3 * 4  # expanded runs
    request = vision.request(prompt, prompt.images)
    ids = request["prompt_token_ids"]
    assert ids.count(pad) == 3
    assert [t for t in ids if t != pad] == [t for t in prompt if t != pad]  # nothing else moved
    starts = [i for i, t in enumerate(ids) if t == processor.start_id]
    assert [ids[i + 1 : i + 3] for i in starts] == [[pad, processor.end_id]] * 3
    images = request["multi_modal_data"]["image"]
    assert [im.size for im in images] == [
        im.size for im in patch_images(prompt.images, processor.image_processor)
    ]


def test_a_rollout_keeps_its_prompts_images(processor: VisionProcessor) -> None:
    prompt = processor(QUESTION, _pictures()[:1])
    kept = own_prompt(prompt)
    assert isinstance(kept, ImagePrompt) and kept.images is prompt.images
    text = [1, 2, 3]
    assert own_prompt(text) == text and own_prompt(text) is not text


def test_a_vision_model_needs_torchvision_where_the_engine_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert VllmImages.of(DEFAULT_MODEL_DIR) is None  # a text model: no check, no processor
    monkeypatch.setattr(
        "tandem.imports.import_error",
        lambda name: "ModuleNotFoundError: No module named 'torchvision'",
    )
    with pytest.raises(ValueError, match="install the torchvision build matching torch"):
        VllmImages.of(VISUAL_MODEL_DIR)
    monkeypatch.setattr("tandem.imports.import_error", lambda name: None)
    vision = VllmImages.of(VISUAL_MODEL_DIR)
    image_pad = load_tokenizer(VISUAL_MODEL_DIR).convert_tokens_to_ids("<|image_pad|>")
    assert vision is not None and vision.image_token_id == image_pad


def test_import_error_names_what_stops_an_import() -> None:
    from tandem.imports import import_error

    assert import_error("json") is None
    error = import_error("tandem_no_such_module")
    assert error is not None and error.startswith("ModuleNotFoundError: ")
