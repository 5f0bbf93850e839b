"""Environments in Ray actors: a pool that runs every live episode's ``reset``/``step`` at once.

Episode ``i`` lives in actor ``i % num_workers`` (an ``EnvironmentHost``, threaded, so the
episodes of one actor step concurrently). Each actor runs in the Python environment of its
actor kind (``cluster/envs.py``; ``environment`` by default, the driver's dependencies), so an
environment that needs packages gets a registered kind of its own. A call that raises inside
the environment comes back as an ``EnvReply`` with ``error`` set (the host catches it); a call
that does not answer within ``step_timeout_s`` of its submission, or whose actor died, ends that
episode with an error too, and the actor is replaced when the episodes of the call end
(``close``): a hung environment costs its episode, never the run.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.exceptions import RayError

from tandem.cluster.envs import runtime_env_for
from tandem.environments.base import EnvironmentHost, EnvReply

logger = logging.getLogger(__name__)


class EnvironmentPool:
    """``num_workers`` environment actors; the ``EnvironmentRunner`` of multi-turn rollouts."""

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any] | None = None,
        num_workers: int = 1,
        step_timeout_s: float = 30.0,
        kind: str = "environment",
        env_mode: str | None = None,
        max_concurrency: int = 64,
        num_cpus: float = 0.0,
        env_vars: dict[str, str] | None = None,
    ):
        """``env_vars`` are added to the actors' environment (e.g. ``PYTHONPATH`` for an
        environment class outside tandem)."""
        self.name, self.kwargs = name, dict(kwargs or {})
        self.step_timeout_s = step_timeout_s
        self._options = {
            "runtime_env": runtime_env_for(kind, env_mode, env_vars),
            "max_concurrency": max_concurrency,
            "num_cpus": num_cpus,
        }
        self._cls = ray.remote(EnvironmentHost)
        self.actors: list[Any] = []
        self._broken: set[int] = set()
        self.num_restarts = 0
        try:
            self.actors = [self._start() for _ in range(num_workers)]
            ray.get([actor.num_live.remote() for actor in self.actors])  # constructed, or raise
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> Any:
        return self._cls.options(**self._options).remote(self.name, self.kwargs)

    def _call(self, method: str, calls: list[tuple[int, Any]]) -> list[EnvReply]:
        refs = [
            getattr(self.actors[i % len(self.actors)], method).remote(i, arg) for i, arg in calls
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.step_timeout_s)
        done = set(ready)
        replies = []
        for (episode, _), ref in zip(calls, refs, strict=True):
            worker = episode % len(self.actors)
            if ref not in done:
                self._broken.add(worker)
                reply = EnvReply(
                    done=True, error=f"{method}: timed out after {self.step_timeout_s}s"
                )
            else:
                try:
                    reply = ray.get(ref)
                except RayError as err:  # the actor died (the host catches the env's errors)
                    self._broken.add(worker)
                    reply = EnvReply(done=True, error=f"{method}: {type(err).__name__}: {err}")
            replies.append(reply)
        return replies

    def reset(self, episodes: list[tuple[int, dict[str, str]]]) -> list[EnvReply]:
        return self._call("reset", episodes)

    def step(self, episodes: list[tuple[int, str]]) -> list[EnvReply]:
        return self._call("step", episodes)

    def close(self, episodes: list[int]) -> None:
        """Drop the episodes' environments; replace the actors that hung or died."""
        for worker in sorted(self._broken):
            logger.warning("environment actor %d hung or died: replacing it", worker)
            ray.kill(self.actors[worker], no_restart=True)
            self.actors[worker] = self._start()
            self.num_restarts += 1
        self._broken.clear()
        by_worker: dict[int, list[int]] = {}
        for episode in episodes:
            by_worker.setdefault(episode % len(self.actors), []).append(episode)
        ray.get([self.actors[w].close.remote(ids) for w, ids in by_worker.items()])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
