"""``HfGenerator``'s image prompts (Qwen2-VL family): the model as its decoders call it, with
the images of a batch.

The decoders prefill a left-padded batch and then feed one token per step with 2D positions
that continue from the prefill's last one. ``ImagePrefill`` stands in for the model: its prefill
call (more than one token) runs on the prompt embeddings with each image's vision features in
place of its ``<|image_pad|>`` tokens and on the multimodal (3-axis) rotary positions the
trainer uses too (``data.images.rope_positions``); its decode calls pass through, their
positions being text positions, equal on the three axes. ``prefill_positions`` gives the
decoders 2D positions whose last column is each row's last multimodal position, so the steps
continue where the trainer's positions go.

The vision tower runs once per distinct image (a prompt's ``n`` samples share its
``ImageInputs``), not once per sample.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.data.images import ImageInputs, RowImages, rope_positions


class ImagePrefill:
    """``model`` as a decoder calls it (``__call__``, ``config``) for one prefill of ``images``
    (the rows' images, None for a row without)."""

    def __init__(self, model: Any, images: RowImages | None):
        self.model = model
        self.config = model.config.text_config
        """What the decoders build their KV cache from (the language model's layers)."""
        self.images = images
        self.positions = torch.zeros(0)
        """``[3, B, T]`` multimodal positions of the prefill (``prefill_positions``)."""

    def prefill_positions(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The decoders' ``[B, T]`` positions of the left-padded prefill (``valid``: its real
        tokens): the temporal axis of the multimodal positions, kept for the prefill call. Its
        last column is each row's last text position, from which the decode steps count on."""
        self.positions = rope_positions(self.model, input_ids, valid.long(), self._merged())
        return self.positions[0]

    def _merged(self) -> ImageInputs | None:
        return None if self.images is None else self.images.merged()

    def _embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt embeddings, image features in place of the image tokens (the tower
        runs on each distinct image once)."""
        body = self.model.model
        embeds = body.get_input_embeddings()(input_ids)
        if self.images is None or self._merged() is None:
            return embeds  # type: ignore[no-any-return]
        distinct: dict[int, ImageInputs] = {}
        for row in self.images.rows:
            if row is not None:
                distinct.setdefault(id(row), row)
        order = list(distinct)
        merged = ImageInputs.merged([distinct[key] for key in order]).to(input_ids.device)
        pooled = body.get_image_features(
            merged.pixel_values.to(embeds.dtype), merged.image_grid_thw, return_dict=True
        ).pooler_output
        per_image = iter(pooled)
        features = {}
        for key in order:  # each row's ImageInputs may hold several images
            count = len(distinct[key].image_grid_thw)
            features[key] = torch.cat([next(per_image) for _ in range(count)])
        rows = [features[id(r)] for r in self.images.rows if r is not None]
        mask = (input_ids == self.model.config.image_token_id)[..., None]
        return embeds.masked_scatter(mask, torch.cat(rows).to(embeds.dtype))  # type: ignore[no-any-return]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> Any:
        if input_ids.shape[1] == 1:  # a decode step: text positions, the same on every axis
            return self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
        assert position_ids.shape == self.positions.shape[1:], "prefill_positions first"
        return self.model(
            inputs_embeds=self._embeddings(input_ids), position_ids=self.positions, **kwargs
        )


def load_generation_model(model_path: str, dtype: torch.dtype) -> Any:
    """The folder's model for generation: a vision-language model through
    ``AutoModelForImageTextToText``, any other through ``AutoModelForCausalLM``."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tandem.data.images import is_vision_model

    auto = (
        AutoModelForImageTextToText if is_vision_model(Path(model_path)) else AutoModelForCausalLM
    )
    return auto.from_pretrained(model_path, dtype=dtype)
