"""A Qwen2-VL-family vision tower's attention over all its windows at once.

The tower attends within windows (Qwen2.5-VL: 112-pixel squares, 64 patches each, in 28 of its
32 blocks) and within whole images (the other blocks); ``cu_seqlens`` marks where each window
starts in the patch sequence, windows being contiguous. Without flash attention transformers
splits the sequence at every window and calls the attention once per window: a 448-pixel image
is 16 windows, so 16 images are 256 calls per block, thousands per forward, as many again in
the backward and its recomputation. Here the windows of one length go through one batched
``scaled_dot_product_attention`` call (``[windows, heads, length, head_dim]``); an image whose
size is not a multiple of the window makes a few lengths, one call each. The same attention,
window by window, as transformers' (the test compares the tower's features and gradients).

``batch_vision_windows(model)`` gives a loaded model's vision attention modules this forward
(their class becomes a subclass of their own; parameters, names and state dicts stay as they
are). It leaves a model alone where its tower asks for flash attention (which takes
``cu_seqlens`` itself) or where its attention module is not the kind described above.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_BATCHED: dict[type, type] = {}
"""Each vision attention class and its batched subclass."""


def _windows(t: torch.Tensor, index: torch.Tensor | None, count: int, length: int) -> torch.Tensor:
    """``[count, heads, length, head_dim]``: the tokens ``index`` of ``t`` (None: all, in order)
    as ``count`` windows of ``length``."""
    picked = t if index is None else t[index]
    return picked.view(count, length, *t.shape[1:]).transpose(1, 2)


def window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``[tokens, heads, head_dim]`` queries, keys and values within each segment
    of ``cu_seqlens`` (contiguous, covering every token): one SDPA call per distinct segment
    length. Returns ``[tokens, heads, head_dim]``."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    distinct = [int(n) for n in lengths.unique().tolist()]
    out = None if len(distinct) == 1 else query.new_zeros(query.shape)
    for length in distinct:
        first = starts[lengths == length]
        # every window alike: a view of the whole sequence, no gather
        index = None if out is None else (first[:, None] + torch.arange(length).to(first)).view(-1)
        q, k, v = (_windows(t, index, len(first), length) for t in (query, key, value))
        part = F.scaled_dot_product_attention(q, k, v, scale=scale)
        part = part.transpose(1, 2).reshape(-1, *query.shape[1:])
        if out is None:
            return part
        out = out.index_put((index,), part)
    assert out is not None
    return out


def _batched_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The module's forward (qkv, the model's own rotary embedding, proj) with
    ``window_attention`` in place of the per-window loop."""
    tokens = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1).permute(1, 0, 2, 3)
    query, key, value = qkv.unbind(0)
    assert position_embeddings is not None, "the tower passes its rotary (cos, sin)"
    rotary = sys.modules[type(self).__mro__[1].__module__].apply_rotary_pos_emb_vision
    query, key = rotary(query, key, *position_embeddings)
    out = window_attention(query, key, value, cu_seqlens, self.scaling)
    return self.proj(out.reshape(tokens, -1))  # type: ignore[no-any-return]


def _batchable(module: nn.Module) -> bool:
    """An attention module of the kind this file replaces the forward of."""
    owner = sys.modules.get(type(module).__module__)
    return (
        all(hasattr(module, name) for name in ("qkv", "proj", "num_heads", "scaling", "config"))
        and hasattr(owner, "apply_rotary_pos_emb_vision")
        and getattr(module.config, "_attn_implementation", None) in ("sdpa", None)
    )


def patch_tower_blocks(
    model: nn.Module, attr: str, fits: Any, forward: Any, prefix: str, made: dict[type, type]
) -> int:
    """Give the ``attr`` module of every block of ``model``'s vision tower (``model`` a
    vision-language model, or its tower itself) that ``fits`` the ``forward``: its class becomes
    a subclass of its own named ``prefix`` + its name (kept in ``made``), so parameters, names
    and state dicts stay as they are. Returns how many (0: no tower, or none fits)."""
    tower = getattr(getattr(model, "model", None), "visual", model)
    changed = 0
    for block in getattr(tower, "blocks", None) or []:
        module = getattr(block, attr, None)
        if module is None or type(module) in made.values() or not fits(module):
            continue
        base = type(module)
        if base not in made:
            made[base] = type(f"{prefix}{base.__name__}", (base,), {"forward": forward})
        module.__class__ = made[base]
        changed += 1
    return changed


def batch_vision_windows(model: nn.Module) -> int:
    """Give the vision tower's attention modules of ``model`` (a vision-language model, or its
    tower itself) the batched forward; returns how many (0: no tower, flash attention, or
    modules of another kind)."""
    return patch_tower_blocks(model, "attn", _batchable, _batched_forward, "Batched", _BATCHED)
