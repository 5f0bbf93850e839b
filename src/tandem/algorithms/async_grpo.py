"""Async GRPO: the generators produce the next steps' rollouts while the trainers train.

``algorithm.max_staleness = k`` bounds how old the rollouts of a step may be: step ``s`` trains
the policy of version ``s - 1`` (the optimizer steps behind it), so its rollouts must come from
weights of version ``>= s - 1 - k``. The pipeline below keeps one generation call per generator
running and decides two things only:

- **submit** step ``j``'s prompts as soon as the generators are free and the weights they hold
  are recent enough for step ``j``;
- **refit** after a step only when the next submission would otherwise break the bound. How it
  meets the running generation is ``algorithm.refit_mode``: ``after_requests`` first waits for
  it (the weights change between generation calls), ``in_flight`` refits at once and the
  generators let the new weights in between two decode steps: the running requests go on with
  them (their KV cache recomputed), the trainers do not wait for the generation to end.

Rewards: a thread of the pipeline collects and scores each generation as soon as it ends, so
scoring overlaps training instead of delaying it.

Versions. The generators label their weights with the version of each refit and every token
with the label of the weights that sampled it (``Rollout.response_versions``); a rollout's
``policy_version`` is the oldest, its first token's. The bound is checked when a generation is
submitted, against the weights the generators hold then; an in-flight refit only makes the rest
of its tokens newer. ``async/staleness_*`` use ``policy_version``; ``async/in_flight_token_frac``
is the share of tokens sampled by weights newer than their rollout's first token.

With ``k = 1`` the generators work on step ``s + 1`` while the trainers train step ``s``, and a
step costs ``max(generate, train) + refit`` instead of their sum; a larger ``k`` also refits less
often. Stale tokens are reweighted by the configured ``rollout_correction`` against the
generator's logprobs, each the logprob of the weights that sampled the token (the old logprobs are
the current policy's, as in AReaL's decoupled PPO).

Prompts: step ``j`` always trains the prompts of data position ``[(j-1) P, j P)``, whatever ran
ahead. On resume the generations that ran ahead of the checkpoint are lost with the process and
their prompts are generated again, for the same steps, from the checkpoint's weights: no prompt
is skipped or trained twice (``data/prompt_start`` and ``data/prompt_digest`` show it).
"""

from __future__ import annotations

import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.algorithms.grpo import Groups, rollout_params, score, train_on_groups
from tandem.algorithms.protocols import PipelinedRuntime
from tandem.config.models import GrpoConfig
from tandem.contracts import PendingGeneration
from tandem.data.prompts import PromptSource

if TYPE_CHECKING:
    from tandem.generation.base import SamplingParams


@dataclass
class _Generation:
    """One step's prompts on their way through the generators."""

    step: int
    prompts: list[dict[str, str]]
    version: int
    """Optimizer steps of the weights the generators held when it was submitted."""
    scored: Future[Groups]
    """Its rollouts and rewards: collected and scored in the pipeline's thread."""


class RolloutPipeline:
    """Runs GRPO steps with generation ahead of training (the module docstring). Call ``step``
    with consecutive step numbers; the first call sets where the run starts (a resumed run's
    generators hold the checkpoint's weights, refitted by the driver)."""

    def __init__(self, runtime: PipelinedRuntime, config: GrpoConfig, source: PromptSource):
        self.runtime, self.config, self.source = runtime, config, source
        self.max_staleness = config.algorithm.max_staleness
        self.in_flight = config.algorithm.refit_mode == "in_flight"
        self.version = -1
        """Version of the generators' weights (-1 until the first step)."""
        self.next_step = 0
        self.running: _Generation | None = None
        self.done: dict[int, tuple[_Generation, Groups]] = {}
        self._waited = 0.0
        # Collects and scores each generation as soon as it ends, while the trainers train: the
        # rewards leave the trainers' path. One thread, and the driver's own thread touches
        # neither the tokenizer nor the scorer until it has waited for it (``_drain``).
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-scoring")
        self.trained = -1
        """The last step trained (-1 before the first)."""

    def step(self, step: int) -> dict[str, float]:
        """Train step ``step`` on its rollouts; refit if the bound needs it; the step's metrics."""
        if self.version < 0:
            self.version, self.next_step = step - 1, step
        start = time.perf_counter()
        self._waited = 0.0
        self._submit_if_allowed()
        generation, groups = self._take(step)
        timings = {"timing/generate_s": self._waited}
        self._submit_if_allowed()  # the generators go on while the trainers train
        in_flight = (len(self.done) + (self.running is not None)) * self._rollouts_per_step
        ages = [step - 1 - r.policy_version for r in groups.rollouts]
        metrics = train_on_groups(
            self.runtime, self.config, groups, step, self.source, timings, fresh=max(ages) == 0
        )
        num_tokens = metrics.pop("num_tokens")
        self.trained = step
        t0 = time.perf_counter()
        refit_stats = self._refit_if_needed(step)
        timings["timing/refit_s"] = time.perf_counter() - t0
        self._submit_if_allowed()
        timings["timing/step_s"] = time.perf_counter() - start
        timings["timing/trainer_idle_s"] = self._waited
        return {
            **metrics,
            "throughput/tokens_per_s": num_tokens / timings["timing/step_s"],
            "refit/gb_per_s": refit_stats.get("gb_per_s", 0.0),
            "async/staleness_mean": sum(ages) / len(ages),
            "async/staleness_max": float(max(ages)),
            "async/rollouts_in_flight": float(in_flight),
            "async/in_flight_token_frac": _newer_token_frac(groups),
            "async/refit": float(self.version == step),
            **self._prompt_accounting(generation),
            **timings,
        }

    def sync_weights(self) -> None:
        """Make the generators hold the trainers' current weights (before an evaluation)."""
        if self.version < self.trained:
            self._drain()
            self._refit(self.trained)

    @property
    def _rollouts_per_step(self) -> int:
        return self.config.algorithm.prompts_per_step * self.config.algorithm.num_generations

    def _allowed(self, step: int) -> bool:
        """Whether rollouts for ``step`` may come from the generators' current weights."""
        return self.version >= step - 1 - self.max_staleness

    def _submit_if_allowed(self) -> None:
        j = self.next_step
        if self.running is not None or j > self.config.algorithm.num_steps or not self._allowed(j):
            return
        prompts = self.source.train_prompts(j - 1, self.config.algorithm.prompts_per_step)
        params = rollout_params(self.config, j)
        pending = self.runtime.submit_generate(
            [self.source.encode(p["prompt"]) for p in prompts], params
        )
        scored = self._scoring.submit(
            self._collect_and_score, pending, prompts, params, self.version
        )
        self.running = _Generation(j, prompts, self.version, scored)
        self.next_step = j + 1

    def _collect_and_score(
        self,
        pending: PendingGeneration,
        prompts: list[dict[str, str]],
        params: SamplingParams,
        version: int,
    ) -> Groups:
        rollouts = self.runtime.collect(pending)
        # the generators label versions; none is older than the weights held at submission
        assert all(r.policy_version >= version for r in rollouts), version
        rewards, scoring = score(self.config, self.source, prompts, rollouts, params)
        return Groups(rollouts, rewards, scoring)

    def _drain(self) -> None:
        """Wait until the running generation is over and scored (the trainers idle meanwhile)."""
        if self.running is None:
            return
        generation, self.running = self.running, None
        t0 = time.perf_counter()
        groups = generation.scored.result()
        self._waited += time.perf_counter() - t0
        self.done[generation.step] = (generation, groups)

    def _take(self, step: int) -> tuple[_Generation, Groups]:
        if step not in self.done:
            assert self.running is not None and self.running.step == step, (step, self.running)
            self._drain()
        return self.done.pop(step)

    def _refit_if_needed(self, step: int) -> dict[str, float]:
        """Refit when the next step to submit needs it: after the running generation, or in
        flight into it."""
        if self.next_step > self.config.algorithm.num_steps or self._allowed(self.next_step):
            return {}
        if not self.in_flight:
            self._drain()
        return self._refit(step)

    def _refit(self, step: int) -> dict[str, float]:
        # after_requests: the trainers go on training while the generators load the weights
        # (their next generation runs after the load); in flight, the load is waited for, so a
        # generation submitted next never starts on the old weights
        stats = self.runtime.refit(version=step, wait_generators=self.in_flight)
        self.version = step
        return stats

    def _prompt_accounting(self, generation: _Generation) -> dict[str, float]:
        """Where the step's prompts start in the data order, and a digest of their text."""
        count = self.config.algorithm.prompts_per_step
        digest = zlib.crc32("\n".join(p["prompt"] for p in generation.prompts).encode())
        return {
            "data/prompt_start": float((generation.step - 1) * count),
            "data/prompt_digest": float(digest),
        }


def _newer_token_frac(groups: Groups) -> float:
    """The share of response tokens sampled by newer weights than their rollout's first token
    (an in-flight refit landed while the rollout was generated)."""
    versions = [v for r in groups.rollouts for v in r.response_versions]
    newer = sum(v > r.policy_version for r in groups.rollouts for v in r.response_versions)
    return newer / max(len(versions), 1)
