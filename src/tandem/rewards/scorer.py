"""Scoring many samples with a reward function: in worker processes, each sample cut off after a
timeout, and every result checked to be a finite number.

A reward that raises stops the run with the user's own traceback (once) and the sample; one
that returns NaN, inf or a non-number, or that hangs, stops it naming the sample, or with
``data.invalid_reward=zero`` scores 0 and is counted (``reward/invalid_count``,
``reward/timeout_count``). A reward that kills its process stops the run naming the exit.

Each worker is a process of its own with a pipe, not a ``multiprocessing.Pool``: a pool cannot
stop one hung task (only the whole pool, whose ``terminate`` then waits for a worker that
ignores SIGTERM, or for the queue lock a killed worker held), and it silently replaces a worker
that died, leaving its task unanswered. Here a hung or dead worker is killed and replaced, and
no lock or semaphore is shared with it.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import numbers
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.rewards.base import RewardError, RewardFn, clip_text
from tandem.rewards.registry import BOUNDED_REWARDS, check_signature, resolve_reward

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


def _serve(spec: str, conn: multiprocessing.connection.Connection) -> None:
    """A worker process: the reward imported (then "ready"), then one result per sample it is
    sent, until its pipe closes. Ctrl-C reaches the whole process group; the driver handles it
    and stops the workers, so they ignore it (no traceback of theirs on the console)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fn = _load(spec)
    conn.send(("ready", None))
    while True:
        try:
            sample = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_call(fn, sample))


class _Worker:
    """One scoring process, its pipe, and the sample it is scoring."""

    def __init__(self, spec: str):
        context = multiprocessing.get_context("spawn")  # the driver holds threads (Ray's, torch's)
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(spec, child), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0

    def send(self, index: int, sample: Sample, timeout_s: float) -> None:
        self.conn.send(sample)
        self.task, self.deadline = index, time.monotonic() + timeout_s

    def exit_description(self) -> str:
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is not None and code < 0:
            return f"signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self) -> None:
        """Killed outright: it holds nothing of the driver's, and a hung reward may ignore
        SIGTERM."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


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
        if fn is not None:
            check_signature(fn, spec)
        self.fn: Callable[[str, str, str], float] = (
            fn if fn is not None else resolve_reward(spec)
        )  # import errors surface now
        self._workers: list[_Worker] = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()

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
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.spec))
        results: list[tuple[str, Any] | None] = [None] * len(samples)
        queue = deque(range(len(samples)))
        while queue or any(w.task is not None for w in self._workers):
            for worker in self._workers:  # a sample's time counts from when a ready worker has it
                if worker.ready and worker.task is None and queue:
                    index = queue.popleft()
                    worker.send(index, samples[index], self.timeout_s)
            self._wait(samples, results)
        return [result for result in results if result is not None]

    def _wait(self, samples: Sequence[Sample], results: list[tuple[str, Any] | None]) -> None:
        """One wait for a message (a result, a worker ready) or the next deadline; a worker past
        its deadline is replaced (its sample timed out), one that died stops the run."""
        busy = [w.deadline for w in self._workers if w.task is not None]
        # a worker that starts (spawn, imports) gets as long as a sample, at least a minute
        timeout = min(busy) - time.monotonic() if busy else max(self.timeout_s, 60.0)
        ready = multiprocessing.connection.wait([w.conn for w in self._workers], max(timeout, 0))
        for worker in self._workers:
            if worker.conn not in ready:
                continue
            try:
                status, value = worker.conn.recv()
            except (EOFError, OSError):
                pending = samples[worker.task] if worker.task is not None else None
                raise RewardError(self._died_message(worker.exit_description(), pending)) from None
            if status == "ready":
                worker.ready = True
            else:
                assert worker.task is not None
                results[worker.task], worker.task = (status, value), None
        if not ready and not busy:
            raise RewardError(
                f"reward {self.spec!r}: no worker process started within {timeout:g} s"
            )
        now = time.monotonic()
        for position, worker in enumerate(self._workers):
            if worker.task is not None and worker.deadline <= now:
                results[worker.task] = ("timeout", self.timeout_s)
                worker.stop()
                self._workers[position] = _Worker(self.spec)

    def _describe(self, sample: Sample) -> str:
        prompt, response, answer = sample
        return (
            f"reward {self.spec!r} on the sample prompt={clip_text(prompt)!r}, "
            f"response={clip_text(response)!r}, answer={clip_text(answer)!r}"
        )

    def _died_message(self, how: str, sample: Sample | None) -> str:
        what = self._describe(sample) if sample is not None else f"reward {self.spec!r}"
        return (
            f"{what}: its worker process died ({how}); a reward must return a float, not exit "
            "or kill its process"
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
