"""A transformers KV cache for the CPU decode of ``HfGenerator``: storage for the whole decode
is allocated once, and each step writes its keys and values in place.

transformers' ``DynamicCache`` concatenates a new copy of every layer's cache at every step:
for 64 rows of a 21M-parameter model decoding 128 tokens (``bench/e2e_cpu.py``'s long
workload) that copied ~15 GB, and writing in place decodes the same tokens sooner. The
``StaticCache`` also writes in place, but attends over its whole length every step; this one
attends over the tokens so far, as the dynamic cache does (figures:
docs/benchmarks/2026-12-05-cpu-e2e-amd.md).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from tandem.attention import full_attention_only


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` over storage for ``capacity`` positions: ``keys``/``values`` are views
    of its first positions, and ``update`` writes the new ones after them."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.storage: tuple[torch.Tensor, torch.Tensor] | None = None
        self.length = 0
        """Positions written so far."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.storage is None:
            self.lazy_initialization(key_states, value_states)
            rows, heads, _, dim = key_states.shape
            self.storage = (
                key_states.new_empty(rows, heads, self.capacity, dim),
                value_states.new_empty(rows, value_states.shape[1], self.capacity, dim),
            )
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the decode outgrew its KV cache: {end} > {self.capacity} positions")
        keys, values = self.storage
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self.length = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.storage is None:
            return
        keys, values = (tensor[indices] for tensor in self.storage)
        self.storage = (keys, values)
        self.keys, self.values = keys[:, :, : self.length], values[:, :, : self.length]


def growing_cache(config: Any, capacity: int) -> Cache | None:
    """A cache of ``GrowingLayer``s for a model of ``config``, or None where its layers are not
    all full attention (sliding windows and linear attention keep transformers' own cache)."""
    if not full_attention_only(config):
        return None
    return Cache(layers=[GrowingLayer(capacity) for _ in range(config.num_hidden_layers)])
