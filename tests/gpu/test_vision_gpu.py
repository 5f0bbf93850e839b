"""The vision tower's MLP padded for the GPU's matmuls (``tandem.vision_mlp``) at the 3B/7B
tower's widths in bf16: as close to a float64 reference as the unpadded MLP, in values and
gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.vision_mlp import _pad_for, padded_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_padded_vision_mlp_is_as_accurate_as_the_unpadded_one() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(1280, 3420), nn.Linear(1280, 3420), nn.Linear(3420, 1280)]
    exact = [layer.double().cuda() for layer in layers]
    half = [nn.Linear(1, 1) for _ in layers]
    for target, source in zip(half, exact, strict=True):
        target.weight = nn.Parameter(source.weight.detach().bfloat16())
        target.bias = nn.Parameter(source.bias.detach().bfloat16())
    act = nn.SiLU()
    hidden = torch.randn(2048, 1280, device="cuda", dtype=torch.float64)
    gate, up, down = half
    module = type("M", (), {"gate_proj": gate, "up_proj": up, "down_proj": down})()
    assert _pad_for(module, hidden.bfloat16()) == 4

    def run(fn, layers_, x):  # type: ignore[no-untyped-def]
        out = fn(x)
        grads = torch.autograd.grad(
            out.float().square().sum(), [p for layer in layers_ for p in layer.parameters()]
        )
        return out.double(), [g.double() for g in grads]

    want, want_grads = run(lambda x: exact[2](act(exact[0](x)) * exact[1](x)), exact, hidden)
    x = hidden.bfloat16()
    plain, plain_grads = run(lambda x: down(act(gate(x)) * up(x)), half, x)
    padded, padded_grads = run(lambda x: padded_mlp(x, gate, up, down, act, 4), half, x)
    plain_err = float((plain - want).abs().max())
    assert float((padded - want).abs().max()) <= 2 * plain_err
    for p, q, w in zip(padded_grads, plain_grads, want_grads, strict=True):
        assert p.shape == w.shape
        scale = float(w.abs().max())
        assert float((p - w).abs().max()) <= 2 * float((q - w).abs().max()) + 1e-3 * scale
