"""The seams between the algorithms and the workers, as types.

``RolloutRuntime`` is what a step function (``grpo_step``, ``evaluate``, ``sft_step``) may call;
``tandem.cluster.runtime.Runtime`` satisfies it structurally, over Ray actors or plain workers in
one process. The types they pass (``LossFn``, ``PendingGeneration``) live in ``tandem.contracts``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tandem.contracts import LossFn, PendingGeneration
    from tandem.data.batch import TrainBatch
    from tandem.generation.base import Rollout, SamplingParams


class RolloutRuntime(Protocol):
    """The workers of a run as the algorithm sees them. Each call makes the memory phase it
    needs true itself (who is resident on the device, which engines are awake), so calls may
    come in any order: the algorithm never offloads, sleeps or wakes anything."""

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """``params.n`` rollouts per prompt, in prompt order."""
        ...

    def policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Token logprobs ``[B, T]`` of the current policy (no gradient)."""
        ...

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Token logprobs ``[B, T]`` of the frozen reference policy."""
        ...

    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on ``batch``; the loss's metrics summed over ranks, and the
        trainer's own figures under ``WORKER_METRICS`` prefixes."""
        ...

    def refit(self, version: int | None = None) -> dict[str, float]:
        """The trainer's weights into every generator, labelled ``version`` (the optimizer
        steps behind them; None: the last label given); the transfer's figures."""
        ...


class PipelinedRuntime(RolloutRuntime, Protocol):
    """A runtime whose generators can work while the trainers train (split placement): async
    GRPO submits a generation, trains, and collects the rollouts later. A refit lands between two
    generations, or with in-flight refit (``RuntimeSpec.in_flight_refit``) between two decode
    steps of the running one."""

    def submit_generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams
    ) -> PendingGeneration:
        """Start generating; returns at once."""
        ...

    def collect(self, pending: PendingGeneration) -> list[Rollout]:
        """The rollouts of ``submit_generate`` in prompt order (waits for them)."""
        ...

    def refit(self, version: int | None = None, wait_generators: bool = True) -> dict[str, float]:
        """As ``RolloutRuntime.refit``; ``wait_generators=False`` returns once the trainers have
        sent, while the generators still load (their next call runs after it)."""
        ...


WORKER_METRICS = ("memory/", "compile/")
"""Prefixes of the trainer's own figures in ``train``'s metrics (its memory; what
``torch.compile`` built in the step): every algorithm logs them under their own names."""


def worker_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The trainer's own figures among ``train``'s ``metrics``."""
    return {k: v for k, v in metrics.items() if k.startswith(WORKER_METRICS)}
