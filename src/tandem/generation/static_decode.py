"""``HfGenerator``'s decode over a static KV cache read in windows (the GPU path): storage
(``kv_cache.WindowedLayer``) written in place, and each step attends over the positions written
so far rounded up to a bucket of ``CACHE_BUCKET`` positions, not over the whole capacity. The
storage holds that window and grows with it, a bucket at a time, so a decode holds the KV cache
of the positions its rows reached, not of every row to the cap: where a growth would not fit
the decode's byte budget, ``room`` says how many rows can go on (the generator parks the others
and resumes them later, as vLLM preempts a request by recomputation). Each step's inputs live
in fixed device buffers, so on a GPU a step replays a CUDA graph; one graph is captured per
(rows, bucket), i.e. again every ``CACHE_BUCKET`` steps (where the storage grows) and when rows
leave the batch (after one eager step of the new batch size).

With ``generation.compile`` the decoder layers run compiled (fused elementwise kernels: a
step of 24 small layers is otherwise bound by the graph's ~40 kernels a layer, not by reading
the weights and cache); every new shape then runs one eager step before its capture, so that
any recompilation happens outside it.

Grouped key/value heads are attended in place (``attention.register_gqa_sdpa``: a decode step's
query heads fold into rows of their key/value head), so no step copies the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from tandem.generation.kv_cache import CacheWindow, WindowedLayer, rows_that_grow, windowed_cache

log = logging.getLogger(__name__)

CACHE_BUCKET = 256
"""Positions by which a decode step's attention window grows: a step reads at most this many
positions beyond the last one written (about 10 % more than needed at a 2k-token context), and
the graphs of a decode of ``S`` steps are captured ``S / CACHE_BUCKET`` times."""


class Decoder(NamedTuple):
    """A decode under way: the next logits, ``advance(token, step)`` (feeds the batch's tokens,
    returns the next logits), ``keep(index)`` (decode only those rows from now on; None where
    the batch cannot shrink) and ``room(step)`` (how many rows ``advance`` can take at
    ``step``; None where the decode's memory is not bounded). The decode's KV cache goes with
    the last reference to it."""

    logits: torch.Tensor
    advance: Callable[[torch.Tensor, int], torch.Tensor]
    keep: Callable[[torch.Tensor], None] | None
    room: Callable[[int], int] | None


def window_length(needed: int, capacity: int, bucket: int) -> int:
    """The positions a step reads: ``needed`` rounded up to a multiple of ``bucket``, at most
    ``capacity``."""
    return min(capacity, -(-needed // bucket) * bucket)


def capture(forward: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor] | None:
    """``forward`` captured as a CUDA graph: (the graph, its static logits), or None where the
    model cannot be captured (a host sync or an uncapturable kernel)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            logits = forward()
    except RuntimeError as err:
        log.warning("hf generator: a CUDA graph capture failed: %s", err)
        return None
    return graph, logits


class StaticDecode:
    """One decode over a windowed static cache: ``prefill`` runs the prompts, ``advance`` one
    step (a graph replay where ``graphs``), ``keep`` drops rows. ``graphs`` turns False for
    good when a capture fails (the generator reads it back)."""

    def __init__(
        self,
        model: Any,
        cache_position: Callable[[torch.Tensor], dict],
        graphs: bool,
        compiled: bool = False,
        budget: int | None = None,
    ):
        self.model = model
        self.budget = budget
        """Bytes the KV cache may take at most (None: no bound; ``room``)."""
        self.cache_position = cache_position
        self.graphs = graphs
        self.compiled = compiled
        """The model's decoder layers are compiled: a graph is captured only over a step of its
        shape that ran before (a new window can guard a compiled layer too)."""
        self.on_capture_failure: Callable[[], bool] = lambda: False
        """Called when a capture fails; returns whether to capture again (the generator
        dropped what kept the capture from working: its compiled layers)."""
        self.bucket = CACHE_BUCKET
        self.graph: tuple[Any, torch.Tensor] | None = None
        self.graph_shape: tuple[int, int] | None = None
        self.warm: tuple[int, int] | int = 0
        """The batch size (compiled: the shape) whose step last ran eagerly (warm-up before a
        capture)."""

    def prefill(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        position_ids: torch.Tensor,
        steps: int,
        tokens: int | None = None,
    ) -> Decoder | None:
        """Prefill the left-padded ``input_ids`` (a key is seen when it is a real token at or
        before the query; a padding query sees itself, so no row is empty) in model calls of at
        most ``tokens`` tokens (None: one call); None where the model's attention is not all
        full attention (the caller decodes otherwise)."""
        device = input_ids.device
        size, width = input_ids.shape
        self.width, self.capacity = width, width + steps
        self.window = CacheWindow(torch.arange(width, device=device), width)
        self.allocated = window_length(width + 1, self.capacity, self.bucket)
        """Positions the storage holds: the first decode step's window, then each window."""
        cache = windowed_cache(self.model.config, self.allocated, self.window, size)
        if cache is None:
            return None
        self.cache = cache
        self.layers = cast(list[WindowedLayer], cache.layers)
        group = size if tokens is None else max(1, min(size, tokens // width))
        chunk = width if tokens is None else max(1, tokens // group)
        logits = []  # each group's last position's
        for row in range(0, size, group):
            for start in range(0, width, chunk):
                last = self._prefill_call(
                    input_ids, valid, position_ids, slice(row, row + group), start, chunk
                )
            logits.append(last)
        # The decode step's inputs: written before each step, read by the graph.
        self.window.rows = slice(None)
        self.window.positions = torch.full((1,), width, dtype=torch.long, device=device)
        self.token = torch.zeros((size, 1), dtype=torch.long, device=device)
        self.position = position_ids[:, -1:].clone()
        self.mask = valid[:, None, None, :].clone()  # [B, 1, 1, capacity]
        return Decoder(torch.cat(logits), self.advance, self.keep, self.room)

    def _prefill_call(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        position_ids: torch.Tensor,
        rows: slice,
        start: int,
        chunk: int,
    ) -> torch.Tensor:
        """One call of the prefill: ``rows`` at positions ``start`` to ``start + chunk``, over
        the keys of their positions before; the logits of the last position."""
        end = min(start + chunk, input_ids.shape[1])
        query = torch.arange(start, end, device=input_ids.device)
        key = torch.arange(end, device=input_ids.device)
        mask = (key[None, :] <= query[:, None])[None] & valid[rows, None, :end]
        mask |= key[None, :] == query[:, None]  # [rows, chunk, end]
        self.window.rows, self.window.positions, self.window.length = rows, query, end
        out = self.model(
            input_ids=input_ids[rows, start:end],
            attention_mask=mask[:, None],
            position_ids=position_ids[rows, start:end],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
            **self.cache_position(query),
        )
        return out.logits[:, -1, :]  # type: ignore[no-any-return]

    def forward(self) -> torch.Tensor:
        """One decode step over the current window (what a graph records)."""
        out = self.model(
            input_ids=self.token,
            attention_mask=self.mask[..., : self.window.length],
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
            **self.cache_position(self.window.positions),
        )
        return out.logits[:, -1, :]  # type: ignore[no-any-return]

    def advance(self, token: torch.Tensor, step: int) -> torch.Tensor:
        written = self.width + step  # the position this step writes
        self.token.copy_(token[:, None])
        self.position.add_(1)
        self.mask[..., written] = True
        self.window.positions.fill_(written)
        self.window.length = window_length(written + 1, self.capacity, self.bucket)
        if self.window.length > self.allocated:
            self.graph = None  # captured over the storage the growth replaces
            for layer in self.layers:
                layer.grow(self.window.length)
            self.allocated = self.window.length
        if not self.graphs:
            return self.forward()
        shape = (len(self.token), self.window.length)
        if self.graph is None or self.graph_shape != shape:
            self.graph = None  # captured for another shape; its memory goes with it
            warm = shape if self.compiled else shape[0]
            if self.warm != warm:  # a new batch size's first step runs eagerly: it warms its
                self.warm = warm  # kernels up (a new window changes no GEMM)
                return self.forward()
            self.graph, self.graph_shape = capture(self.forward), shape  # records; runs nothing
            if self.graph is None:
                self.graphs = self.on_capture_failure()
                self.compiled, self.warm = False, 0  # the next capture warms up first
                return self.forward()
        self.graph[0].replay()
        return self.graph[1].clone()

    def room(self, step: int) -> int:
        """How many of the batch's rows ``advance`` can take at ``step``: all of them unless the
        step's window outgrows the storage and the storage grown for every row would not fit
        ``budget``; then as many as fit up to the cap, so that a decode parks rows once (and
        those parked go on together, not one at a time)."""
        rows = len(self.token)
        grown = window_length(self.width + step + 1, self.capacity, self.bucket)
        if self.budget is None or grown <= self.allocated:
            return rows
        config, dtype = self.model.config, self.layers[0].storage_dtype()
        if rows_that_grow(config, dtype, self.budget, self.allocated, grown) >= rows:
            return rows
        return rows_that_grow(config, dtype, self.budget, self.allocated, self.capacity)

    def keep(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.token, self.position, self.mask = (
            self.token[index],
            self.position[index],
            self.mask[index],
        )
        self.graph = self.graph_shape = None  # captured for the larger batch
