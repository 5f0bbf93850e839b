"""Megatron-core's core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Without Transformer Engine, megatron-core's local layer spec attends with
``DotProductAttention``: it materialises the ``[b * heads, s, s]`` scores with ``baddbmm`` in the
compute dtype (bf16 scores, rounded before the fp32 softmax) and repeats the key/value heads.
SDPA keeps the scores in fp32 inside a fused kernel (flash or memory-efficient on CUDA), reads
grouped key/value heads as they are (``enable_gqa``), and never stores the scores: closer to the
fp32 result and to what the FSDP2 trainer's transformers model computes, and faster at long
sequences.

The tandem trainer's masks are causal (rows are right-padded), so the mask Megatron passes is
replaced by SDPA's own causal one. CUDA only, like the rest of the backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SdpaAttention(DotProductAttention):  # type: ignore[misc]
    """``DotProductAttention``'s settings (heads per partition, softmax scale), SDPA's kernel."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Query ``[s, b, heads, d]``, key/value ``[s, b, groups, d]`` -> ``[s, b, heads * d]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SdpaAttention: no packed sequences or attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        grouped = k.shape[1] != q.shape[1]  # read as they are, not repeated per query head
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=grouped
        )
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def local_spec_with_sdpa() -> Any:
    """megatron-core's local GPT layer spec (RMSNorm) with ``SdpaAttention`` as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec
