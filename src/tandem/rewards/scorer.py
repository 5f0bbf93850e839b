"""Scoring many samples with a reward function: in worker processes, each sample cut off after a
timeout, and every result checked to be a finite number.

A reward that raises stops the run with the user's own traceback (once) and the sample; one
that returns NaN, inf or a non-number, or that hangs, stops it naming the sample, or with
``data.invalid_reward=zero`` scores 0 and is counted (``reward/invalid_count``,
``reward/timeout_count``).
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.pool
import numbers
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.rewards.base import RewardError, RewardFn, clip_text
from tandem.rewards.registry import BOUNDED_REWARDS, resolve_reward

Sample = tuple[str, str, str]
"""(prompt, response, answer) of one rollout."""

_LOADED: dict[str, RewardFn] = {}
"""Reward functions already imported in this (worker) process, by spec."""


@dataclass
class Scores:
    rewards: list[float]
    """One reward per sample, in sample order."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What scoring cost and how many samples were invalid or timed out."""


def _load(spec: str) -> RewardFn:
    """The reward of ``spec``, imported once per (worker) process."""
    fn = _LOADED.get(spec)
    if fn is None:
        fn = _LOADED[spec] = resolve_reward(spec)
    return fn


def _warm_up(spec: str) -> None:
    """A worker's first task: the import done, and long enough that each worker takes one."""
    _load(spec)
    time.sleep(0.05)


def _score_one(spec: str, sample: Sample) -> tuple[str, Any]:
    """Runs in a worker: ("ok", float) | ("invalid", description) | ("raised", traceback)."""
    return _call(_load(spec), sample)


def _call(fn: Callable[[str, str, str], float], sample: Sample) -> tuple[str, Any]:
    try:
        value = fn(*sample)
    except Exception:
        return "raised", traceback.format_exc()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "invalid", f"{type(value).__name__} {clip_text(repr(value), 100)}"
    value = float(value)
    return ("ok", value) if math.isfinite(value) else ("invalid", f"{value}")


class RewardScorer:
    """Scores samples with the reward named by ``spec`` (a built-in or ``module:function``).

    ``num_workers >= 1`` scores in that many spawned processes, each sample cut off after
    ``timeout_s``; 0 scores in this process (``fn`` may then be any callable, e.g. in tests).
    The built-in rewards that cannot hang (``BOUNDED_REWARDS``) are always scored in this
    process: a worker's round trip costs more than they do (figures:
    docs/benchmarks/2026-12-05-cpu-e2e-amd.md), and no pool is started for them.
    """

    def __init__(
        self,
        spec: str,
        num_workers: int = 0,
        timeout_s: float = 60.0,
        invalid: Literal["error", "zero"] = "error",
        fn: Callable[[str, str, str], float] | None = None,
    ):
        self.spec, self.num_workers, self.timeout_s, self.invalid = (
            spec,
            0 if spec in BOUNDED_REWARDS else num_workers,
            timeout_s,
            invalid,
        )
        self.fn: Callable[[str, str, str], float] = (
            fn if fn is not None else resolve_reward(spec)
        )  # import errors surface now
        self._pool: multiprocessing.pool.Pool | None = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __call__(self, prompt: str, response: str, answer: str) -> float:
        """One sample, in this process (a plain ``RewardFn``)."""
        return self.score([(prompt, response, answer)]).rewards[0]

    def score(self, samples: Sequence[Sample]) -> Scores:
        start = time.perf_counter()
        counts = {"reward/invalid_count": 0.0, "reward/timeout_count": 0.0}
        rewards = []
        for index, (status, value) in enumerate(self._results(samples)):
            if status == "ok":
                rewards.append(value)
                continue
            if status == "raised":
                raise RewardError(f"{self._describe(samples[index])} raised:\n{value.rstrip()}")
            if self.invalid == "error":
                raise RewardError(self._invalid_message(samples[index], status, value))
            counts[f"reward/{status}_count"] += 1
            rewards.append(0.0)
        return Scores(rewards, {**counts, "timing/reward_s": time.perf_counter() - start})

    def _results(self, samples: Sequence[Sample]) -> list[tuple[str, Any]]:
        if self.num_workers == 0:
            return [_call(self.fn, sample) for sample in samples]
        results: list[tuple[str, Any]] = []
        while len(results) < len(samples):
            pool = self._ensure_pool()
            pending = [
                pool.apply_async(_score_one, (self.spec, sample))
                for sample in samples[len(results) :]
            ]
            for job in pending:
                try:
                    # results come in order: when the previous one is in, this one has had its
                    # own worker for at least this long
                    results.append(job.get(timeout=self.timeout_s))
                except multiprocessing.TimeoutError:
                    self.close()  # the only way to stop a hung worker; the rest are re-sent
                    results.append(("timeout", self.timeout_s))
                    break
        return results

    def _ensure_pool(self) -> multiprocessing.pool.Pool:
        if self._pool is None:
            # spawn: the driver holds Ray's threads, which a fork would copy mid-state
            self._pool = multiprocessing.get_context("spawn").Pool(self.num_workers)
            # started and imported before any sample's time counts
            self._pool.map(_warm_up, [self.spec] * self.num_workers, chunksize=1)
        return self._pool

    def _describe(self, sample: Sample) -> str:
        prompt, response, answer = sample
        return (
            f"reward {self.spec!r} on the sample prompt={clip_text(prompt)!r}, "
            f"response={clip_text(response)!r}, answer={clip_text(answer)!r}"
        )

    def _invalid_message(self, sample: Sample, status: str, value: Any) -> str:
        if status == "timeout":
            problem = f"took longer than data.reward_timeout_s={value:g} s"
        else:
            problem = f"returned {value}, not a finite number"
        return (
            f"{self._describe(sample)} {problem} (set data.invalid_reward=zero to score such "
            "samples 0 and count them instead)"
        )
