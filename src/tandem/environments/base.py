"""The environment interface, the registry of environments and the host that runs them.

Write an environment as a class with ``reset(sample) -> str`` and ``step(response) ->
(observation, reward, done)``; one instance plays one episode. A class may also provide
``samples(count, seed, held_out) -> list[dict]`` (``{"prompt", "answer"}`` rows), which
``data.task: environment`` trains and evaluates on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tandem.imports import import_named

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "arithmetic_feedback": "tandem.environments.arithmetic_feedback:ArithmeticFeedbackEnv",
    "calculator": "tandem.environments.calculator:CalculatorEnv",
    "guess_number": "tandem.environments.guess_number:GuessNumberEnv",
}


@runtime_checkable
class Environment(Protocol):
    """One episode's counterpart. Instances are built with the recipe's
    ``environment.kwargs`` and used for one episode only."""

    def reset(self, sample: dict[str, str]) -> str:
        """The first observation (the task the model sees first) for ``sample``."""
        ...

    def step(self, response: str) -> tuple[str, float, bool]:
        """``(observation, reward, done)`` after the model's ``response`` (its decoded turn, cut
        before a stop string). ``observation`` is appended to the context when not done."""
        ...


@dataclass(frozen=True)
class EnvReply:
    """What the driver learns from one ``reset`` or ``step`` of one episode."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    error: str | None = None
    """Set when the environment raised or timed out: the episode ends, the run goes on."""


def environment_class(spec: str) -> type:
    """The class named by ``spec``: a built-in name or ``package.module:Class``."""
    path = BUILTIN_ENVIRONMENTS.get(spec, spec)
    cls = import_named("environment", path, BUILTIN_ENVIRONMENTS, "Class")
    if not isinstance(cls, type):
        attr = path.partition(":")[2]
        raise ValueError(f"environment {spec!r}: {attr!r} is a {type(cls).__name__}, not a class")
    return cls


class EnvironmentHost:
    """Live environments of many episodes, keyed by episode id (what one env actor holds).

    A method that raises does not propagate: it becomes an ``EnvReply`` with ``error`` set and
    the episode is dropped, so one bad episode never stops the others."""

    def __init__(self, name: str, kwargs: dict[str, Any] | None = None):
        self.cls = environment_class(name)
        self.kwargs = dict(kwargs or {})
        self.episodes: dict[int, Any] = {}

    def reset(self, episode: int, sample: dict[str, str]) -> EnvReply:
        try:
            env = self.cls(**self.kwargs)
            observation = env.reset(sample)
        except Exception as err:  # an environment's bug ends its episode, not the run
            return EnvReply(done=True, error=f"reset: {type(err).__name__}: {err}")
        self.episodes[episode] = env
        return EnvReply(observation=str(observation))

    def step(self, episode: int, response: str) -> EnvReply:
        env = self.episodes.get(episode)
        if env is None:
            return EnvReply(done=True, error=f"step: episode {episode} is not live")
        try:
            observation, reward, done = env.step(response)
        except Exception as err:
            self.episodes.pop(episode, None)
            return EnvReply(done=True, error=f"step: {type(err).__name__}: {err}")
        if done:
            self.episodes.pop(episode, None)
        return EnvReply(observation=str(observation), reward=float(reward), done=bool(done))

    def close(self, episodes: list[int]) -> None:
        for episode in episodes:
            self.episodes.pop(episode, None)

    def num_live(self) -> int:
        return len(self.episodes)


class InProcessEnvironments:
    """The environments of a run in the driver's process (tests, debugging): the
    ``EnvironmentRunner`` of ``tandem.algorithms.multiturn`` without actors or timeouts."""

    def __init__(self, name: str, kwargs: dict[str, Any] | None = None):
        self.host = EnvironmentHost(name, kwargs)

    def reset(self, episodes: list[tuple[int, dict[str, str]]]) -> list[EnvReply]:
        return [self.host.reset(i, sample) for i, sample in episodes]

    def step(self, episodes: list[tuple[int, str]]) -> list[EnvReply]:
        return [self.host.step(i, response) for i, response in episodes]

    def close(self, episodes: list[int]) -> None:
        self.host.close(episodes)
