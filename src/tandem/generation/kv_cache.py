"""transformers KV caches of ``HfGenerator``'s decode. For the CPU: storage for the whole decode
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


def _storage(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    capacity: int,
    make: Any,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``capacity`` positions for the heads of the first states and
    ``rows`` rows (None: those of the states; ``make``: ``torch.empty`` or ``torch.zeros``)."""
    batch, heads, _, dim = key_states.shape
    rows = batch if rows is None else rows
    like = {"dtype": key_states.dtype, "device": key_states.device}
    return (
        make(rows, heads, capacity, dim, **like),
        make(rows, value_states.shape[1], capacity, dim, **like),
    )


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
            self.storage = _storage(key_states, value_states, self.capacity, torch.empty)
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


class CacheWindow:
    """Where the layers of a ``windowed_cache`` write and how much of it attention reads: the
    next call's ``positions`` (a device tensor the decode updates in place, so a captured CUDA
    graph reads it), ``length``, the positions read from the start (a Python int: each
    value is its own shape, so its own graph), and ``rows``, the rows of the batch the call
    runs (a prefill in groups of rows; a decode step: all of them)."""

    def __init__(self, positions: torch.Tensor, length: int, rows: slice = slice(None)) -> None:
        self.positions = positions
        self.length = length
        self.rows = rows


class WindowedLayer(DynamicLayer):
    """Storage for ``rows`` rows (None: those of the first call) of ``capacity`` positions
    allocated at the first call (a static cache: its address moves only when it ``grow``s or
    drops rows, so CUDA graphs replay over it between); ``update`` writes the new keys and
    values of ``window.rows`` at ``window.positions`` and returns their first
    ``window.length`` positions, so attention reads the part written so far (in buckets), not
    the whole capacity."""

    def __init__(self, capacity: int, window: CacheWindow, rows: int | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.window = window
        self.rows = rows
        self.storage: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.storage is None:
            self.lazy_initialization(key_states, value_states)
            self.storage = _storage(key_states, value_states, self.capacity, torch.zeros, self.rows)
        rows, length = self.window.rows, self.window.length
        keys, values = self.storage[0][rows], self.storage[1][rows]
        keys.index_copy_(2, self.window.positions, key_states)
        values.index_copy_(2, self.window.positions, value_states)
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        return self.keys, self.values

    def grow(self, capacity: int) -> None:
        """Storage for ``capacity`` positions (more than now): the positions so far copied
        into it, the old storage freed with its last view."""
        self.capacity = capacity
        if self.storage is None:
            return
        old = self.storage
        self.storage = _storage(*old, capacity, torch.zeros)
        for new, written in zip(self.storage, old, strict=True):
            new[:, :, : written.shape[2]] = written
        self.keys, self.values = self.storage

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (new, smaller storage; the old is freed with its last view)."""
        if self.storage is None:
            return
        self.storage = (self.storage[0][indices], self.storage[1][indices])
        self.keys, self.values = self.storage

    def get_seq_length(self) -> int:
        return self.window.length if self.storage is not None else 0

    def storage_dtype(self) -> torch.dtype:
        """The keys' and values' dtype (after the first update)."""
        assert self.storage is not None, "no update yet"
        return self.storage[0].dtype


class WindowedCache(Cache):
    """A ``Cache`` of ``WindowedLayer``s whose ``update`` runs eagerly in compiled decoder layers
    (``generation.compile``): it reads the window's length, a Python int that compiled code
    would specialise on, compiling again for every window; the layers' code before and after
    it compiles once for every batch size and window."""

    @torch.compiler.disable
    def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return super().update(*args, **kwargs)  # type: ignore[no-any-return]


def windowed_cache(
    config: Any, capacity: int, window: CacheWindow, rows: int | None = None
) -> Cache | None:
    """A cache of ``WindowedLayer``s for ``rows`` rows sharing ``window``, or None where the
    model's layers are not all full attention."""
    if not full_attention_only(config):
        return None
    layers: list[Any] = [
        WindowedLayer(capacity, window, rows) for _ in range(config.num_hidden_layers)
    ]
    return WindowedCache(layers=layers)


def kv_bytes_per_position(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one row's position takes in every layer of a model of ``config``
    (a vision-language model's text config), in ``dtype``."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return int(text.num_hidden_layers * 2 * heads * head_dim * dtype.itemsize)


PREFILL_TOKENS = 1 << 14
"""Tokens (rows x positions) a GPU decode's prefill runs through the model in one call: a
windowed decode's rows go in groups of ``PREFILL_TOKENS // positions`` (a row longer than that,
in chunks of positions), another decode's positions in chunks of ``PREFILL_TOKENS // rows``,
so the prefill's activations (``prefill_bytes``) are bounded whatever the rows and their
lengths; a refit or a resumed row prefills again all that its rows decoded."""


def prefill_bytes(config: Any, dtype: torch.dtype, tokens: int) -> int:
    """The widest activations of a prefill call over ``tokens`` tokens: the MLP's up and gate
    projections and their product, and the keys and values repeated for every query head
    (transformers' sdpa repeats grouped heads for a masked GPU kernel)."""
    text = getattr(config, "text_config", None) or config
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return tokens * (3 * intermediate + 2 * text.num_attention_heads * head_dim) * dtype.itemsize


def row_extra_bytes(config: Any, dtype: torch.dtype, width: int) -> int:
    """What each row of a decode of ``width`` prompt positions holds on the device besides its
    KV cache, at its peak: its prefill's activations over its prompt (``prefill_bytes``; none
    for ``width=0``) and its logits with their fp32 sampling copies."""
    text = getattr(config, "text_config", None) or config
    logits = text.vocab_size * (dtype.itemsize + 8)
    return prefill_bytes(config, dtype, width) + logits


def row_bytes(config: Any, dtype: torch.dtype, width: int, steps: int) -> int:
    """What each row of a decode of ``width`` prompt positions and ``steps`` new tokens holds on
    the device at its peak: its KV cache for every position and ``row_extra_bytes``."""
    kv = kv_bytes_per_position(config, dtype) * (width + steps)
    return kv + row_extra_bytes(config, dtype, width)


def rows_that_grow(config: Any, dtype: torch.dtype, budget: int, now: int, grown: int) -> int:
    """How many decoding rows of a windowed cache of ``now`` positions can grow to ``grown``
    within ``budget`` bytes: each row's cache at ``grown`` positions and its logits
    (``row_extra_bytes`` of no prompt), and while one layer grows, its copy at ``now``."""
    layers = (getattr(config, "text_config", None) or config).num_hidden_layers
    per_position = kv_bytes_per_position(config, dtype)
    each = per_position * grown + per_position // layers * now + row_extra_bytes(config, dtype, 0)
    return max(0, budget // each)


DECODE_HEADROOM = 1 << 30
"""Device bytes a GPU decode keeps free besides its rows (``row_bytes`` each): the sampling
block (``hf_generator.SAMPLE_BLOCK_CUDA``), the captured steps' memory pools, kernel
workspaces. At 7B x 2048 tokens on an H100 the generator's process peaked under 1 GB above its
weights and rows (docs/benchmarks/2026-12-07-h100-cells.md)."""


def decode_budget(free: int | None) -> int | None:
    """Bytes a decode may hold of the device's ``free`` ones: all but ``DECODE_HEADROOM``
    (None: no bound, a CPU)."""
    return None if free is None else free - DECODE_HEADROOM


def decode_rows(total: int, limit: int, each: int, layers: int, free: int | None) -> int:
    """How many of ``total`` rows decode together: at most ``limit``, and where the device's
    ``free`` bytes are known, as many as fit at ``each`` bytes a row beside
    ``DECODE_HEADROOM`` and a compaction's copy of one layer's rows
    (``hf_generator.COMPACT_AT``); the chunks as even as that allows (a last chunk of a few
    rows would decode as long as a full one). 0 where not one row fits."""
    fit = limit
    if free is not None:
        fit = min(limit, int((free - DECODE_HEADROOM) // (each * (1 + 1 / layers))))
    if fit < 1:
        return 0
    chunks = -(-total // fit)
    return -(-total // chunks)
