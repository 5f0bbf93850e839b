"""The generator interface shared by the vLLM and the transformers backends.

Logprob semantics (both backends): ``Rollout.response_logprobs[i]`` is the log-probability of
the sampled token under the model's *raw* next-token distribution, i.e. ``log_softmax`` of the
unmodified logits, before temperature, top-k or top-p. That is vLLM's default
(``logprobs_mode="raw_logprobs"``) and what the trainer recomputes, so the generator/trainer
logprob mismatch after a refit measures the weights, not the sampling settings.

Seeding: ``SamplingParams.seed`` seeds the whole call; sample ``j`` of prompt ``i`` draws from
its own stream seeded with ``seed + i * n + j``, so a sample does not depend on what else is in
the batch. Callers vary ``seed`` between steps.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from tandem.config.models import SamplingConfig

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one ``generate`` call (``n`` responses per prompt)."""

    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_tokens: int = 64
    n: int = 1
    stop: tuple[str, ...] = ()
    """Stop strings; the response is cut before the first one (and it is not included)."""
    seed: int | None = 0

    @classmethod
    def from_config(cls, config: SamplingConfig, n: int = 1, **overrides: Any) -> SamplingParams:
        """From the ``generation.sampling`` section; ``n`` is ``algorithm.num_generations``."""
        values: dict[str, Any] = {
            "temperature": config.temperature,
            "top_p": config.top_p,
            "top_k": config.top_k,
            "max_tokens": config.max_tokens,
            "n": n,
            "stop": tuple(config.stop),
            "seed": config.seed,
        }
        values.update(overrides)
        return cls(**values)

    def sample_seed(self, prompt_index: int, sample_index: int) -> int | None:
        if self.seed is None:
            return None
        return self.seed + prompt_index * self.n + sample_index


@dataclass
class Rollout:
    """One generated response."""

    prompt_index: int
    """Index of the prompt in the ``generate`` call."""
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    """Generated tokens, including a final EOS when the model stopped on it."""
    response_text: str
    """Decoded response without special tokens, cut before a stop string."""
    response_logprobs: list[float] = field(default_factory=list)
    """Raw-model logprob of each token of ``response_token_ids`` (see the module docstring)."""
    finish_reason: FinishReason = "length"
    response_mask: list[int] | None = None
    """Multi-turn episodes: 1 on the tokens the model generated, 0 on those the environment's
    turns added (never trained on); None: every response token is generated."""
    policy_version: int = 0
    """Optimizer steps of the weights that generated it (set by the rollout pipeline)."""


class Generator(abc.ABC):
    """A rollout engine. Implementations: ``VllmGenerator``, ``HfGenerator``."""

    device: torch.device
    """Where the weights live (refit receivers deliver tensors there)."""

    @abc.abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """``params.n`` rollouts per prompt, grouped: rollouts ``[i*n, (i+1)*n)`` are prompt i's."""

    @abc.abstractmethod
    def load_weights(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Update the weights in place from ``(hf_name, tensor)`` pairs, then reset any prefix
        cache. The stream must cover whole layers (a refit sends every weight)."""

    def receive_weights(self, spec: Any, first_rank: int = 1) -> None:
        """Run the ``weight_sync`` receiver described by ``spec`` (as receiver ``first_rank``:
        generator ``i`` of a group is ``1 + i``) and load what it yields."""
        from tandem.weight_sync import make_receiver

        self.load_weights(make_receiver(spec, self.device, rank=first_rank).iter_weights())

    def sleep(self) -> None:  # noqa: B027 - optional capability, default no-op
        """Release weights and KV cache memory (colocated mode). No-op where unsupported."""

    def wake_up(self, tags: list[str] | None = None) -> None:  # noqa: B027
        """Undo ``sleep`` for ``tags`` (``"weights"``, ``"kv_cache"``; None: all), so a refit
        can land before the KV cache takes its memory. No-op where unsupported."""

    @property
    def supports_sleep(self) -> bool:
        """Whether ``sleep`` really frees memory (False: it is a no-op)."""
        return False

    def shutdown(self) -> None:  # noqa: B027
        """Release the engine; the generator is unusable afterwards."""


def group_rollouts(rollouts: list[Rollout], n: int) -> list[list[Rollout]]:
    """Split the flat ``generate`` output into one list of ``n`` rollouts per prompt."""
    assert len(rollouts) % n == 0, (len(rollouts), n)
    return [rollouts[i : i + n] for i in range(0, len(rollouts), n)]
