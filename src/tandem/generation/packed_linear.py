"""Linear layers of the CPU generator with their weights pre-packed for oneDNN.

``F.linear`` on a CPU runs MKL's GEMM, which on an AMD CPU takes MKL's AVX2 path and computes a
decode step's small-batch products markedly slower than oneDNN over a weight reordered once into
its blocked layout (the layout vLLM-cpu keeps for its linear layers). Below about 0.5 MiB a
weight's product is too small to pay for oneDNN's per-call cost, and those layers stay plain
(the embedded 0.8M-parameter model has none above it). Figures:
docs/benchmarks/2026-12-05-cpu-e2e-amd.md.

A packed layer keeps its ``weight`` and ``bias`` parameters (the same tensors, under the same
names), so a refit still copies into them; the generator then calls ``repack`` for the packed
copy to follow. Inference only: the packed product has no gradient. It is an ``nn.Linear``
(its own forward), so peft wraps it as any linear layer: LoRA adapters on the CPU generator
(``hf_adapters``) compute their low-rank part beside the packed product.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACK_MIN_BYTES = 512 * 1024
"""The smallest weight packed."""

_BATCH_HINT = 64
"""The rows oneDNN lays a weight out for (a decode step's batch; any count works)."""


class PackedLinear(nn.Linear):
    """``nn.Linear``'s product through oneDNN over a packed copy of the weight."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight of its own
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = torch.empty(0)
        self.repack()

    @torch.no_grad()
    def repack(self) -> None:
        """Pack the weight again (after it changed)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def pack_linears(model: nn.Module) -> list[PackedLinear]:
    """Replace ``model``'s float32 CPU ``nn.Linear`` layers of ``PACK_MIN_BYTES`` or more by
    ``PackedLinear``s (in place) and return them; none where this torch lacks oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return []
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.weight.numel() * module.weight.element_size() >= PACK_MIN_BYTES
    ]
    packed = []
    for name, linear in targets:
        try:
            layer = PackedLinear(linear)
        except RuntimeError as err:  # a oneDNN build that cannot pack this weight
            log.warning("hf generator: %s stays a plain linear layer (%s)", name, err)
            continue
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, layer)
        packed.append(layer)
    return packed
