"""What a Hugging Face model config says about its attention, and the generator's attention function
(grouped key/value heads read in place under a mask)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def full_attention_only(config: Any) -> bool:
    """Whether every layer of a model of ``config`` attends to all earlier tokens: no sliding
    windows and no linear attention, which an explicit mask or a cache of our own would
    drop."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return not (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    )


GQA_SDPA = "tandem_gqa_sdpa"
"""transformers' ``sdpa`` attention, except that a masked grouped-query attention reads the
key/value heads as they are instead of copying each one for every query head it serves
(``register_gqa_sdpa``)."""


def folded_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of one query position ``[B, H, 1, D]`` over ``[B, Hkv, L, D]`` keys and values
    with ``H`` a multiple of ``Hkv``: the query heads that share a key/value head become that
    head's query rows (``[B, Hkv, H / Hkv, D]``), so the keys are read once per key/value head
    by any SDPA kernel, masked or not (CUDA's fused kernels take no mask with ``enable_gqa``).
    The mask (``[B, 1, 1, L]``) broadcasts over the rows. Returns ``[B, H, 1, D]``."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    rows = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, scale=scale)
    return out.reshape(batch, heads, 1, dim)


def register_gqa_sdpa() -> str:
    """Register ``GQA_SDPA`` with transformers (attention and mask) and return its name.

    transformers' sdpa repeats the key/value heads whenever a mask is given (``use_gqa_in_sdpa``),
    because CUDA's fused kernels take no mask with grouped heads: a left-padded decode (every
    step has a mask) then copied every layer's whole cache at every step. Here a decode step
    (one query position) folds the grouped query heads into query rows
    (``folded_decode_attention``: no copy, any kernel, any device), and on a CPU a longer
    query reads the grouped heads in place (``enable_gqa``: torch's CPU kernel takes a mask
    with it). Elsewhere (no mask, no grouped heads, a prefill on a GPU, a position bias or a
    paged cache) this is transformers' sdpa itself."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        grouped = getattr(module, "num_key_value_groups", 1) > 1
        plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None
        masked = grouped and plain and attention_mask is not None and dropout == 0.0
        if masked and query.shape[2] == 1:
            out = folded_decode_attention(query, key, value, attention_mask, scaling)
        elif masked and query.device.type == "cpu":
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
            )
        else:
            return sdpa_attention_forward(  # type: ignore[no-any-return]
                module, query, key, value, attention_mask, dropout, scaling, **kwargs
            )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(GQA_SDPA, forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA
