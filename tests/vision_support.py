"""Shared pieces of the vision tower tests (no tests here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.assets import VISUAL_MODEL_DIR


def tiny_vl_pair(patch: Callable[[Any], int]) -> tuple[Any, Any]:
    """Two copies of the embedded vision-language model, the second with ``patch`` applied to
    its tower: it patches every block once (a second call patches none) and keeps every
    state-dict name."""
    from transformers import AutoModelForImageTextToText

    plain = AutoModelForImageTextToText.from_pretrained(str(VISUAL_MODEL_DIR))
    patched = AutoModelForImageTextToText.from_pretrained(str(VISUAL_MODEL_DIR))
    names = list(patched.state_dict())
    assert patch(patched) == len(patched.model.visual.blocks)
    assert patch(patched) == 0  # once is enough
    assert list(patched.state_dict()) == names
    return plain, patched
