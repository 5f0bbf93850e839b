"""``HfGenerator``'s image prompts (Qwen2-VL family): the model as its decoders call it, with
the images of a batch.

The decoders prefill a left-padded batch and then feed one token per step with 2D positions
that continue from the prefill's last one. ``ImagePrefill`` stands in for the model: its prefill
call (more than one token) runs on the prompt embeddings with each image's vision features in
place of its image tokens and on the multimodal (3-axis) rotary positions, as the trainer's
forward does (``data.images.vision_inputs``); its decode calls pass through, their positions
being text positions, equal on the three axes. ``prefill_positions`` gives the decoders 2D
positions whose last column is each row's last multimodal position, so the steps continue
where the trainer's positions go. The vision tower runs once per distinct image (a prompt's
``n`` samples share its ``ImageInputs``), not once per sample, and the prefill once per
distinct row: the same tokens and the same images (``same_prefill``; prompts may hold the same
tokens and different images).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem.data.images import RowImages, distinct_rows, is_vision_model, vision_inputs
from tandem.vision_attention import batch_vision_windows
from tandem.vision_mlp import align_vision_mlps


class ImagePrefill:
    """``model`` as a decoder calls it (``__call__``, ``config``) for one prefill of ``images``
    (the rows' images; None: a batch of text prompts)."""

    def __init__(self, model: Any, images: RowImages | None):
        self.model = model
        self.config = model.config.text_config
        """What the decoders build their KV cache from (the language model's layers)."""
        self.images = images
        self.prefill: tuple[torch.Tensor, torch.Tensor] | None = None
        """The prefill's embeddings and ``[3, B, T]`` positions (``prefill_positions``)."""

    def prefill_positions(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The decoders' ``[B, T]`` positions of the left-padded prefill (``valid``: its real
        tokens): the temporal axis of the multimodal positions. Its last column is each row's
        last text position, from which the decode steps count on."""
        first, inverse = same_prefill(input_ids, valid, self.images)
        images = None if self.images is None else self.images.select(first.cpu())
        images = None if images is None else images.to(input_ids.device)
        embeds, positions = vision_inputs(self.model, input_ids[first], valid[first].long(), images)
        self.prefill = embeds[inverse], positions[:, inverse]  # computed once per distinct row
        return self.prefill[1][0]

    def rows(self, index: torch.Tensor) -> ImagePrefill:
        """This prefill for the rows ``index`` only (after ``prefill_positions``)."""
        assert self.prefill is not None, "prefill_positions first"
        images = None if self.images is None else self.images.select(index.cpu())
        picked = ImagePrefill(self.model, images)
        embeds, positions = self.prefill
        picked.prefill = (embeds[index], positions[:, index])
        return picked

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> Any:
        if input_ids.shape[1] == 1:  # a decode step: text positions, the same on every axis
            return self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
        assert self.prefill is not None, "prefill_positions first"
        embeds, positions = self.prefill
        assert positions.shape[1:] == input_ids.shape
        return self.model(inputs_embeds=embeds, position_ids=positions, **kwargs)


def same_prefill(
    input_ids: torch.Tensor, valid: torch.Tensor, images: RowImages | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with the same prefill (``data.images.distinct_rows``): the same tokens at the same
    real positions (``valid``) and, for image prompts, the same images."""
    keyed = torch.where(valid[:, : input_ids.shape[1]], input_ids, -1)
    if images is not None:
        keyed = torch.cat([keyed, images.keys()[:, None].to(keyed.device)], dim=1)
    return distinct_rows(keyed)


def load_generation_model(model_path: str, dtype: torch.dtype) -> Any:
    """The folder's model for generation: a vision-language model through
    ``AutoModelForImageTextToText``, any other through ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if not is_vision_model(Path(model_path)):
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype)
    batch_vision_windows(model)  # the tower's windows in one attention call per length
    align_vision_mlps(model)  # its MLP's width padded for the GPU's fast matmuls
    return model
