"""The vision tower's windows attended in batched calls (``tandem.vision_attention``): the same
values and gradients as one attention call per window, as transformers computes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vision_support import tiny_vl_pair

from tandem.assets import VISUAL_MODEL_DIR
from tandem.vision_attention import batch_vision_windows, window_attention


def per_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """One SDPA call per segment, as transformers' non-flash path does."""
    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        a, b, c = (t[start:end].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(a, b, c, scale=0.25).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("cu", [[0, 4, 8, 12, 16], [0, 4, 8, 11, 15, 16, 20]])
def test_windows_of_one_or_several_lengths_match_one_call_per_window(cu: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(cu[-1], 3, 16, generator=gen, requires_grad=True) for _ in range(3))
    bounds = torch.tensor(cu, dtype=torch.int32)
    got = window_attention(q, k, v, bounds, 0.25)
    want = per_window(q, k, v, bounds)
    assert (got - want).abs().max() <= 1e-6
    weights = torch.randn(got.shape, generator=gen)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for a, b in zip(grads, expected, strict=True):
        assert (a - b).abs().max() <= 1e-6


def _tower_features(model: torch.nn.Module, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(VISUAL_MODEL_DIR))
    gen = torch.Generator().manual_seed(size)
    images = [
        Image.fromarray((torch.rand(s, s, 3, generator=gen) * 255).byte().numpy(), "RGB")
        for s in (size, size + 16)
    ]
    out = processor(images=images, return_tensors="pt")
    pixels, grid = out["pixel_values"].float(), out["image_grid_thw"]
    pooled = model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
    return pixels, torch.cat(list(pooled))


@pytest.mark.parametrize("size", [48, 64])
def test_the_tiny_tower_computes_what_it_computed_window_by_window(size: int) -> None:
    plain, batched = tiny_vl_pair(batch_vision_windows)
    _, want = _tower_features(plain, size)
    _, got = _tower_features(batched, size)
    assert (got - want).abs().max() <= 1e-5
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, a), b in zip(
        batched.model.visual.named_parameters(), plain.model.visual.parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None
        assert (a.grad - b.grad).abs().max() <= 1e-4 * max(1.0, float(b.grad.abs().max())), name
