"""The vision MLP's hidden width padded to a multiple of 8 (``tandem.vision_mlp``): the same
values and gradients as the unpadded MLP, and only where it pays (CUDA, 2-byte weights of an
unaligned width, plain linear layers)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vision_support import tiny_vl_pair

from tandem.vision_mlp import _pad_for, align_vision_mlps, padded_mlp


def _mlp(width: int, bias: bool, dtype: torch.dtype) -> SimpleNamespace:
    torch.manual_seed(0)
    return SimpleNamespace(
        gate_proj=nn.Linear(16, width, bias=bias, dtype=dtype),
        up_proj=nn.Linear(16, width, bias=bias, dtype=dtype),
        down_proj=nn.Linear(width, 16, bias=bias, dtype=dtype),
        act_fn=nn.SiLU(),
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(), nn.Sigmoid()])  # sigmoid(0) != 0
def test_padding_the_width_keeps_values_and_gradients(bias: bool, act: nn.Module) -> None:
    m = _mlp(30, bias, torch.float64)  # 30 units: 2 to add for 8
    hidden = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    want = m.down_proj(act(m.gate_proj(hidden)) * m.up_proj(hidden))
    grads_want = torch.autograd.grad(want.square().sum(), [hidden, *_params(m)])
    got = padded_mlp(hidden, m.gate_proj, m.up_proj, m.down_proj, act, extra=2)
    grads_got = torch.autograd.grad(got.square().sum(), [hidden, *_params(m)])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(grads_got, grads_want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _params(m: SimpleNamespace) -> list[torch.Tensor]:
    return [p for part in (m.gate_proj, m.up_proj, m.down_proj) for p in part.parameters()]


def test_the_pad_is_asked_only_on_a_gpu_for_two_byte_unaligned_plain_layers() -> None:
    on_gpu = SimpleNamespace(is_cuda=True)
    assert _pad_for(_mlp(3420, True, torch.bfloat16), on_gpu) == 4  # type: ignore[arg-type]
    assert _pad_for(_mlp(3420, True, torch.float16), on_gpu) == 4  # type: ignore[arg-type]
    assert _pad_for(_mlp(3424, True, torch.bfloat16), on_gpu) == 0  # type: ignore[arg-type]
    assert _pad_for(_mlp(3420, True, torch.float32), on_gpu) == 0  # type: ignore[arg-type]
    assert _pad_for(_mlp(3420, True, torch.bfloat16), torch.zeros(1)) == 0  # a CPU tensor
    wrapped = _mlp(3420, True, torch.bfloat16)
    wrapped.up_proj = nn.Sequential(wrapped.up_proj)  # a layer peft would have wrapped
    assert _pad_for(wrapped, on_gpu) == 0  # type: ignore[arg-type]


def test_the_tiny_models_tower_mlps_take_the_forward_and_compute_as_before() -> None:
    plain, aligned = tiny_vl_pair(align_vision_mlps)
    assert align_vision_mlps(nn.Linear(2, 2)) == 0  # no tower
    hidden = torch.randn(7, plain.model.visual.blocks[0].mlp.gate_proj.in_features)
    for a, b in zip(aligned.model.visual.blocks, plain.model.visual.blocks, strict=True):
        assert type(a.mlp).__name__ == f"Aligned{type(b.mlp).__name__}"
        assert torch.equal(a.mlp(hidden), b.mlp(hidden))  # on a CPU: the module's own forward
