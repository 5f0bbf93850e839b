"""Image prompts: token ids that carry their images' pixel tensors, the batch rows that keep
them, and the model's processor that makes them (Qwen2-VL family).

A Qwen2-VL prompt holds one ``<|image_pad|>`` token per merged patch of each image (between
``<|vision_start|>`` and ``<|vision_end|>``); the model replaces those tokens' embeddings by the
vision tower's outputs. So an image prompt is its token ids (``ImagePrompt``, a ``list[int]``
that everything taking prompt ids passes along unchanged: the runtime's chunking, the
workers, pickling between actors) with its ``ImageInputs`` attached: the processor's
``pixel_values`` (flattened patches) and ``image_grid_thw`` (patches per image along time,
height and width).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class ImageInputs:
    """The vision inputs of one prompt, as the model's forward takes them."""

    pixel_values: torch.Tensor
    """``[num_patches, channels * temporal_patch * patch * patch]`` float32 patches."""
    image_grid_thw: torch.Tensor
    """``[num_images, 3]`` int64 patches per image along (time, height, width)."""

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.image_grid_thw.to(device))

    @staticmethod
    def merged(parts: Sequence[ImageInputs]) -> ImageInputs:
        """The inputs of several prompts in order, as one forward of their rows takes them."""
        return ImageInputs(
            torch.cat([p.pixel_values for p in parts]),
            torch.cat([p.image_grid_thw for p in parts]),
        )


class ImagePrompt(list[int]):
    """A prompt's token ids (image placeholders expanded) with its ``images``. A list of ints
    to everything that handles prompt ids; the generators and batches read ``images``."""

    images: ImageInputs

    def __init__(self, token_ids: Iterable[int], images: ImageInputs):
        super().__init__(token_ids)
        self.images = images


def prompt_images(prompt: Sequence[int]) -> ImageInputs | None:
    """The images a prompt carries (None for a text prompt)."""
    return prompt.images if isinstance(prompt, ImagePrompt) else None


def own_prompt(prompt: Sequence[int]) -> list[int]:
    """A rollout's copy of its prompt: an image prompt itself (its images go on to the
    trainer's batch), a text prompt as a plain list."""
    return prompt if isinstance(prompt, ImagePrompt) else list(prompt)


@dataclass
class RowImages:
    """The images of each row of a batch (none for some rows), selected with its rows.

    Rows that share images (a prompt's samples) share them explicitly: ``distinct`` holds each
    ``ImageInputs`` once and ``index`` each row's position in it (-1: no image), so the vision
    tower runs once per distinct entry. Identity alone would not survive a map over the
    batch's tensors: FSDP2 casts a root module's forward inputs by rebuilding every dataclass
    it finds, which gave each row its own copy (the tower then ran once per row)."""

    distinct: list[ImageInputs]
    index: list[int]

    @staticmethod
    def from_rows(rows: Sequence[ImageInputs | None]) -> RowImages:
        """Rows holding the same ``ImageInputs`` object share its entry."""
        seen: dict[int, int] = {}
        distinct: list[ImageInputs] = []
        index: list[int] = []
        for row in rows:
            if row is not None and id(row) not in seen:
                seen[id(row)] = len(distinct)
                distinct.append(row)
            index.append(-1 if row is None else seen[id(row)])
        return RowImages(distinct, index)

    @staticmethod
    def of(prompts: Sequence[Sequence[int]]) -> RowImages | None:
        """The rows' images, or None when no prompt has any (a text batch)."""
        images = [prompt_images(p) for p in prompts]
        return RowImages.from_rows(images) if any(i is not None for i in images) else None

    @property
    def rows(self) -> list[ImageInputs | None]:
        """Each row's images (the same object for rows that share them)."""
        return [None if i < 0 else self.distinct[i] for i in self.index]

    def select(self, index: slice | torch.Tensor | list[int]) -> RowImages:
        rows = self.rows
        if isinstance(index, slice):
            return RowImages.from_rows(rows[index])
        picks = index.tolist() if isinstance(index, torch.Tensor) else index
        if isinstance(picks, int):
            picks = [picks]
        return RowImages.from_rows([rows[int(i)] for i in picks])

    def to(self, device: torch.device | str) -> RowImages:
        """On ``device``: each distinct entry copied once."""
        return RowImages([d.to(device) for d in self.distinct], list(self.index))

    def merged(self) -> ImageInputs | None:
        """One forward's inputs (rows in order), None when no row has an image."""
        present = [r for r in self.rows if r is not None]
        return ImageInputs.merged(present) if present else None

    def keys(self) -> torch.Tensor:
        """Per row, which of the distinct ``ImageInputs`` it holds (-1: none): rows of equal
        keys hold the same images (a prompt's samples share its ``ImageInputs``)."""
        return torch.tensor(self.index, dtype=torch.long)


def distinct_rows(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of each distinct row of ``keys`` ``[B, K]``, and each row's index into
    those (row ``i`` equals row ``first[inverse[i]]``)."""
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    size = keys.shape[0]
    first = torch.full((len(unique),), size, device=keys.device)
    first.scatter_reduce_(0, inverse, torch.arange(size, device=keys.device), "amin")
    return first, inverse


def decode_image(value: Any, where: str) -> Any:
    """A ``datasets.Image`` cell (a path, bytes, or ``{"path", "bytes"}``) as an RGB PIL image;
    one that is missing or unreadable is a ``ValueError`` naming ``where`` (file and row)."""
    import datasets

    if value is None:
        raise ValueError(f"{where}: no image (the image column is empty)")
    if isinstance(value, str | Path):
        value = {"path": str(value), "bytes": None}
    elif isinstance(value, bytes):
        value = {"path": None, "bytes": value}
    path = value.get("path")
    if value.get("bytes") is None and path is not None and not Path(path).is_file():
        raise ValueError(f"{where}: image file not found: {path}")
    try:
        image = datasets.Image().decode_example(value)
        image.load()
    except Exception as err:  # PIL's own error names what it met
        what = path or "the embedded bytes"
        raise ValueError(f"{where}: cannot read image {what} ({err})") from None
    return image.convert("RGB")


def png_bytes(image: Any) -> bytes:
    """``image`` (PIL) as PNG bytes (what a Parquet file of images holds)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class VisionProcessor:
    """Text and images to an ``ImagePrompt``: the model's image processor (transformers' class
    for it, from the folder's ``preprocessor_config.json``) makes the patches, the tokenizer
    the text, and each image becomes ``<|vision_start|>``, one ``<|image_pad|>`` per merged
    patch, ``<|vision_end|>`` (ids from the model's config). Images come first, then the text,
    as Qwen2-VL's chat format lays them out."""

    def __init__(self, model_path: Path, tokenizer: Any):
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(str(model_path))
        if getattr(config, "vision_config", None) is None:
            raise ValueError(
                f"{model_path} is a text-only model ({config.model_type}); image prompts need a "
                "vision-language model folder (e.g. Qwen2-VL / Qwen2.5-VL)"
            )
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_path))
        self.tokenizer = tokenizer
        self.merge = int(config.vision_config.spatial_merge_size)
        self.image_token_id = int(config.image_token_id)
        self.start_id = int(config.vision_start_token_id)
        self.end_id = int(config.vision_end_token_id)

    def __call__(self, text: str, images: Sequence[Any]) -> ImagePrompt:
        out = self.image_processor(images=list(images), return_tensors="pt")
        grid = out["image_grid_thw"].long()
        ids: list[int] = []
        for thw in grid.tolist():
            count = thw[0] * thw[1] * thw[2] // self.merge**2
            ids += [self.start_id, *[self.image_token_id] * count, self.end_id]
        ids += list(self.tokenizer.encode(text, add_special_tokens=False))
        return ImagePrompt(ids, ImageInputs(out["pixel_values"].float(), grid))


def patch_images(images: ImageInputs, processor: Any) -> list[Any]:
    """The RGB PIL images that ``processor`` (a Qwen2-VL image processor) made ``images``'
    patches from, at the size it resized them to: processing them again gives the same
    patches without a resize (an engine that takes images, not patches, sees the trainer's
    pixels). The first frame of each temporal patch (an image's two frames are equal)."""
    from PIL import Image

    p, t, m = processor.patch_size, processor.temporal_patch_size, processor.merge_size
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    out, start = [], 0
    for gt, gh, gw in images.image_grid_thw.tolist():
        flat = images.pixel_values[start : start + gt * gh * gw].float()
        start += gt * gh * gw
        # the processor's (t, h/m, w/m, m, m, c, tp, p, p) patch order back to (t*tp, c, H, W)
        grid = flat.view(gt, gh // m, gw // m, m, m, 3, t, p, p).permute(0, 6, 5, 1, 3, 7, 2, 4, 8)
        frame = grid.reshape(gt * t, 3, gh * p, gw * p)[0]
        pixels = (frame * std + mean) / processor.rescale_factor
        array = pixels.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        out.append(Image.fromarray(array, "RGB"))
    return out


def is_vision_model(model_path: Path) -> bool:
    """Whether the folder's config has a vision tower (reads config.json only)."""
    import json

    config = Path(model_path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def vision_inputs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: RowImages | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen2-VL-family ``model``'s (the ``...ForConditionalGeneration``) inputs for rows
    ``input_ids`` with their images ``rows``: the token embeddings with each image's vision
    features in place of its image tokens, and the ``[3, B, T]`` multimodal rotary positions
    (the model's own ``get_rope_index``; text tokens share one position on the three axes, the
    first after an image the image's largest plus one).

    Only the first image tokens of a row, as many as its images have merged patches, are
    images: a sampled response may hold the image token too, and it is text there (the model's
    forward alone would count it as an image, and without token types it falls back to 1D
    positions). The vision tower runs once per distinct ``ImageInputs`` (a prompt's samples
    share theirs), its features scattered to every row that holds it."""
    body = model.model
    merge = int(model.config.vision_config.spatial_merge_size)
    rows = rows if rows is not None else RowImages([], [-1] * len(input_ids))
    per_row = rows.rows
    counts = [0 if r is None else int(r.image_grid_thw.prod(-1).sum()) // merge**2 for r in per_row]
    is_image = input_ids == model.config.image_token_id
    is_image &= is_image.cumsum(-1) <= torch.tensor(counts, device=input_ids.device)[:, None]
    present = [r for r in per_row if r is not None]
    positions = _positions(body, input_ids, is_image, attention_mask, rows)
    embeds = body.get_input_embeddings()(input_ids)
    if not present:
        return embeds, positions
    distinct = list({id(r): r for r in present}.values())
    merged = ImageInputs.merged(distinct).to(input_ids.device)
    pooled = iter(
        body.get_image_features(
            merged.pixel_values.to(embeds.dtype), merged.image_grid_thw, return_dict=True
        ).pooler_output
    )
    features = {  # each ImageInputs may hold several images
        id(r): torch.cat([next(pooled) for _ in range(len(r.image_grid_thw))]) for r in distinct
    }
    scattered = torch.cat([features[id(r)] for r in present]).to(embeds.dtype)
    return embeds.masked_scatter(is_image[..., None], scattered), positions


def _positions(
    body: Any, input_ids: torch.Tensor, is_image: torch.Tensor, mask: torch.Tensor, rows: RowImages
) -> torch.Tensor:
    """``get_rope_index``'s ``[3, B, T]`` positions, computed once per distinct row: positions
    depend on the token types of the real tokens and on the images alone, and the model's
    function walks the rows one by one in Python (half of a micro-batch's extra time for
    images on the CPU, its rows the samples of a few prompts)."""
    types = torch.where(mask.bool(), is_image.long(), -1)
    first, inverse = distinct_rows(torch.cat([types, rows.keys()[:, None].to(types.device)], 1))
    per_row = rows.rows
    picked = [per_row[i] for i in first.tolist()]
    grids = [r.image_grid_thw for r in picked if r is not None]
    grid = torch.cat(grids).to(input_ids.device) if grids else None
    positions, _ = body.get_rope_index(
        input_ids[first], is_image[first].int(), image_grid_thw=grid, attention_mask=mask[first]
    )
    return positions[:, inverse]
