"""A Qwen2.5-VL vision tower's gated MLP with its hidden width padded to a multiple of 8.

Qwen2.5-VL-3B and -7B's towers are 1280 wide with an MLP of 3420: in bf16 a row of 3420 is
6,840 bytes, not a multiple of 16, so cuBLAS cannot give the MLP's three matmuls (gate, up:
their outputs' rows; down: its input's) the Hopper kernels, which read and write through
16-byte-aligned strides, and runs Ampere ones at a fraction of the rate. Padding the hidden width
with zeros (4 rows of the gate's and the up projection's weights and biases, 4 columns of the
down projection's) is exact: the padded units' up projection is 0, so their product is 0 and the
down projection's padded columns meet zeros; the gradients of the real weights are those of the
unpadded MLP (the pad's backward is a slice). The pads are copies of the weights in each
forward (26 MB a block at the 3B shape), not of the activations.

``align_vision_mlps(model)`` gives a loaded model's vision MLP modules this forward (their class
becomes a subclass of their own; parameters, names and state dicts stay as they are). It pads
only where it helps: on a CUDA device, with 2-byte weights whose hidden width is not a multiple
of 8, and while the three projections are plain linear layers (peft's LoRA layers take the
module's own forward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.vision_attention import patch_tower_blocks

ALIGN_BYTES = 16
"""The stride alignment cuBLAS's Hopper kernels need."""

_ALIGNED: dict[type, type] = {}
"""Each vision MLP class and its aligned subclass."""


def padded_mlp(
    hidden: torch.Tensor, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act: Any, extra: int
) -> torch.Tensor:
    """``down(act(gate(hidden)) * up(hidden))`` with ``extra`` zero units added to the width."""

    def rows(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if linear.bias is None else F.pad(linear.bias, (0, extra))
        return F.pad(linear.weight, (0, 0, 0, extra)), bias

    product = act(F.linear(hidden, *rows(gate))) * F.linear(hidden, *rows(up))
    return F.linear(product, F.pad(down.weight, (0, extra)), down.bias)


def _pad_for(module: Any, hidden: torch.Tensor) -> int:
    """How many units to add (0: run the module's own forward)."""
    parts = (module.gate_proj, module.up_proj, module.down_proj)
    if not hidden.is_cuda or any(type(p) is not nn.Linear for p in parts):
        return 0
    weight = module.gate_proj.weight
    per = ALIGN_BYTES // weight.element_size()
    return 0 if weight.element_size() > 2 else -weight.shape[0] % per


def _aligned_forward(self: Any, hidden_state: torch.Tensor) -> torch.Tensor:
    extra = _pad_for(self, hidden_state)
    if not extra:
        return type(self).__mro__[1].forward(self, hidden_state)  # type: ignore[attr-defined,no-any-return]
    return padded_mlp(
        hidden_state, self.gate_proj, self.up_proj, self.down_proj, self.act_fn, extra
    )


def _gated(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, name, None), nn.Linear)
        for name in ("gate_proj", "up_proj", "down_proj")
    ) and callable(getattr(module, "act_fn", None))


def align_vision_mlps(model: nn.Module) -> int:
    """Give the vision tower's gated MLP modules of ``model`` (a vision-language model, or its
    tower itself) the padded forward; returns how many (0: no tower, or MLPs of another kind)."""
    return patch_tower_blocks(model, "mlp", _gated, _aligned_forward, "Aligned", _ALIGNED)
