"""The types at the seams between the algorithms, the workers and the runtime, defined once
and below all of them: ``algorithms/``, ``trainer/``, ``cluster/`` and ``rewards/`` import them
from here, and this module imports nothing of tandem's.

``LossFn`` is the contract of every loss the trainer minimises (``algorithms/losses.py``);
``RewardFn`` of every reward (``rewards/``); ``PendingGeneration`` is the handle of a generation
that runs while the caller goes on (async GRPO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from tandem.data.batch import TrainBatch

Count = int | float

Metrics = dict[str, "torch.Tensor"]


class LossFn(Protocol):
    """``loss, metrics = loss_fn(logprobs, micro_batch, num_global_tokens, num_global_sequences)``

    ``logprobs`` ``[b, T]`` carries the gradient; the counts are over the whole batch (every
    micro-batch and data-parallel rank), and the loss is already divided by them, so losses and
    metrics summed over micro-batches and ranks give the full-batch values. ``entropy`` (with
    grad) is passed when the trainer computes it."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        micro_batch: TrainBatch,
        num_global_tokens: Count,
        num_global_sequences: Count,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]: ...


class RewardFn(Protocol):
    """Scores one sample: the prompt text, the generated response text and the reference
    answer of the dataset row. Returns a float (1.0 / 0.0 for verifiers)."""

    def __call__(self, prompt: str, response: str, answer: str) -> float: ...


@dataclass(frozen=True)
class PendingGeneration:
    """A generation in progress: each generator's prompt indices and its pending result (what
    the runtime's worker group returned for the call)."""

    chunks: list[list[int]]
    futures: Any
