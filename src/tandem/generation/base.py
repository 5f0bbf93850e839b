"""The generator interface shared by the vLLM and the transformers backends.

Logprob semantics (both backends): ``Rollout.response_logprobs[i]`` is the log-probability of
the sampled token under the model's *raw* next-token distribution, i.e. ``log_softmax`` of the
unmodified logits, before temperature, top-k or top-p. That is vLLM's default
(``logprobs_mode="raw_logprobs"``) and what the trainer recomputes, so the generator/trainer
logprob mismatch after a refit measures the weights, not the sampling settings.

Weights during a generation (in-flight refit): a generator's decode steps run under its
``WeightGate``; a weight update waits for the step in progress, lands before the next one, and the
requests go on with the new weights. Their KV cache is recomputed with the new weights first
(vLLM preempts and re-prefills the running requests, the transformers backend prefills prompt and
response so far again), so every token and its logprob come from one set of weights over the whole
context. ``Rollout.response_versions`` says which weights sampled each token.

Seeding: ``SamplingParams.seed`` seeds the whole call; sample ``j`` of prompt ``i`` draws from
its own stream seeded with ``seed + i * n + j``, so a sample does not depend on what else is in
the batch. Callers vary ``seed`` between steps.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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
    response_versions: list[int] = field(default_factory=list)
    """Version of the weights (``WeightGate.version``) that sampled each response token; they
    differ within a rollout only when a refit landed while it was being generated."""
    policy_version: int = 0
    """The oldest weights that sampled any of its tokens: the version at its first token."""


class WeightGate:
    """Takes turns between a generator's decode steps and its weight updates.

    Each decode step runs under ``step()``, each weight update under ``update()``, never two at
    once. An update that waits goes before the next step (steps come back to back, a plain lock
    would starve it), so a refit lands between two steps of a running generation, within one
    step. ``version`` labels the weights: 0 for those loaded at start, then what each
    ``update(version)`` says (None keeps the label: the same policy sent again)."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._busy = False
        self.waiting_updates = 0
        self.version = 0

    @contextmanager
    def step(self) -> Iterator[int]:
        """One decode step; yields the version of the weights it runs with."""
        with self._turn:
            self._turn.wait_for(lambda: not self._busy and self.waiting_updates == 0)
            self._busy = True
            version = self.version
        try:
            yield version
        finally:
            self._release()

    @contextmanager
    def update(self, version: int | None = None) -> Iterator[None]:
        """A weight update: waits for the step in progress; the new version holds once the
        block completes (a failed update keeps the old label)."""
        with self._turn:
            self.waiting_updates += 1
            self._turn.wait_for(lambda: not self._busy)
            self.waiting_updates -= 1
            self._busy = True
        try:
            yield
            self.version = self.version if version is None else version
        finally:
            self._release()

    def _release(self) -> None:
        with self._turn:
            self._busy = False
            self._turn.notify_all()


class Generator(abc.ABC):
    """A rollout engine. Implementations: ``VllmGenerator``, ``HfGenerator``."""

    device: torch.device
    """Where the weights live (refit receivers deliver tensors there)."""

    def __init__(self) -> None:
        self.gate = WeightGate()
        """Decode steps and weight updates take turns here (in-flight refit)."""

    @abc.abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """``params.n`` rollouts per prompt, grouped: rollouts ``[i*n, (i+1)*n)`` are prompt i's."""

    @abc.abstractmethod
    def load_weights(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Update the weights in place from ``(hf_name, tensor)`` pairs, then reset any prefix
        cache. The stream must cover whole layers (a refit sends every weight). While a
        generation runs in another thread, call it under ``gate.update()``."""

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

    def take_stats(self) -> dict[str, float]:
        """Metrics of the generations since the last call, by name (the runtime adds them to
        the step's, summed over generators); none by default."""
        return {}

    def shutdown(self) -> None:  # noqa: B027
        """Release the engine; the generator is unusable afterwards."""


def group_rollouts(rollouts: list[Rollout], n: int) -> list[list[Rollout]]:
    """Split the flat ``generate`` output into one list of ``n`` rollouts per prompt."""
    assert len(rollouts) % n == 0, (len(rollouts), n)
    return [rollouts[i : i + n] for i in range(0, len(rollouts), n)]
