"""What a Hugging Face model config says about its attention, for layouts and caches of our own."""

from __future__ import annotations

from typing import Any


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


CPU_GQA_SDPA = "tandem_cpu_gqa_sdpa"
"""transformers' ``sdpa`` attention, except that on a CPU a masked grouped-query attention
reads the key/value heads as they are (``enable_gqa``) instead of copying each one for every
query head it serves (``register_cpu_gqa_sdpa``)."""


def register_cpu_gqa_sdpa() -> str:
    """Register ``CPU_GQA_SDPA`` with transformers (attention and mask) and return its name.

    transformers' sdpa repeats the key/value heads whenever a mask is given (``use_gqa_in_sdpa``),
    because CUDA's fused kernels take no mask with grouped heads. torch's CPU kernel does, with
    the same result: a left-padded decode (every step has a mask) then copied every layer's
    whole cache at every step. Elsewhere (no mask, no grouped heads, not on a CPU, a position
    bias or a paged cache) this is transformers' sdpa itself."""
    import torch
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
        if not (grouped and plain and attention_mask is not None and query.device.type == "cpu"):
            return sdpa_attention_forward(  # type: ignore[no-any-return]
                module, query, key, value, attention_mask, dropout, scaling, **kwargs
            )
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(CPU_GQA_SDPA, forward)
    AttentionMaskInterface.register(CPU_GQA_SDPA, sdpa_mask)
    return CPU_GQA_SDPA
