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
