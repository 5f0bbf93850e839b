"""Typed batches that cross the boundary between the driver and the workers.

Token-aligned convention used everywhere: for a sequence ``input_ids[b, :]`` the per-token tensors
(``logprobs``, ``advantages``, ``loss_mask``...) have the same shape ``[B, T]`` and entry ``t``
refers to token ``t`` as predicted from tokens ``< t``. Entry 0 (which nothing predicts) and
padding are 0 and masked out by ``loss_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from tandem.data.images import RowImages


@dataclass
class TrainBatch:
    """A right-padded batch of prompt+response sequences and the per-token training signals."""

    input_ids: torch.Tensor
    """[B, T] int64 token ids: prompt followed by response, right-padded."""
    attention_mask: torch.Tensor
    """[B, T] 1 for real tokens (prompt and response), 0 for padding."""
    loss_mask: torch.Tensor
    """[B, T] 1 for response tokens that are trained on, 0 elsewhere (prompt, padding)."""
    advantages: torch.Tensor | None = None
    """[B, T] float32 advantage per token (a sequence's advantage broadcast over its tokens)."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] logprobs of the policy that generated the data, as the trainer computes them."""
    generator_logprobs: torch.Tensor | None = None
    """[B, T] logprobs reported by the generator (for the importance-ratio correction)."""
    reference_logprobs: torch.Tensor | None = None
    """[B, T] logprobs of the frozen reference policy (for the KL penalty)."""
    images: RowImages | None = None
    """Image prompts: each row's images (``data.images``), which follow their rows through
    ``select`` (micro-batches, shards); None for a text batch."""

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of trained (loss-masked) tokens."""
        return int(self.loss_mask.sum().item())

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The ``[B, T]`` tensors that are set."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "images" and getattr(self, f.name) is not None
        }

    def select(self, index: slice | torch.Tensor) -> TrainBatch:
        """Rows ``index`` of every tensor and their images (micro-batches, data-parallel
        shards)."""
        values: dict[str, Any] = {k: v[index] for k, v in self._tensors().items()}
        images = None if self.images is None else self.images.select(index)
        return TrainBatch(**values, images=images)

    def columns(self, index: slice) -> TrainBatch:
        """Columns ``index`` of every tensor (all of them are ``[B, T]``); images as they are."""
        values: dict[str, Any] = {k: v[:, index] for k, v in self._tensors().items()}
        return TrainBatch(**values, images=self.images)

    def to(self, device: torch.device | str) -> TrainBatch:
        values: dict[str, Any] = {k: v.to(device) for k, v in self._tensors().items()}
        images = None if self.images is None else self.images.to(device)
        return replace(self, **values, images=images)


def right_padded(rows: list[tuple[list[int], list[int]]], pad_token_id: int) -> TrainBatch:
    """A batch of ``(prompt ids, response ids)`` rows, each prompt followed by its response and
    right-padded; the loss covers the responses. Image prompts bring their images."""
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for row, (prompt, response) in enumerate(rows):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response)
        attention_mask[row, :end] = 1
        loss_mask[row, len(prompt) : end] = 1.0
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        images=RowImages.of([prompt for prompt, _ in rows]),
    )
