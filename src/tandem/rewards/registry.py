"""Resolve ``data.reward`` (a built-in name or ``package.module:function``) to a reward."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tandem.imports import import_named
from tandem.rewards.base import RewardFn, checked
from tandem.rewards.exact_match import exact_match
from tandem.rewards.math_answer import math_verify_reward

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math_verify": math_verify_reward,
}
BOUNDED_REWARDS = frozenset({"exact_match"})
"""Built-in rewards whose time per sample is bounded (one linear regex search): they cannot
hang, so they need no worker to be cut off in, and are scored in the caller's process."""


def _import_reward(spec: str) -> RewardFn:
    fn = import_named("reward", spec, BUILTIN_REWARDS, "function")
    if not callable(fn):
        attr = spec.partition(":")[2]
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    check_signature(fn, spec)
    return fn  # type: ignore[no-any-return]


def check_signature(fn: Callable[..., Any], spec: str) -> None:
    """``fn`` can be called as ``fn(prompt, response, answer)``; otherwise a ValueError saying
    which arguments a reward takes (before the first sample, not as a TypeError in a worker)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its first call will tell
        return
    try:
        signature.bind("prompt", "response", "answer")
    except TypeError as err:
        raise ValueError(
            f"reward {spec!r} takes {signature}, but a reward is called with three positional "
            f"arguments (prompt, response, answer) and returns a float ({err})"
        ) from None


def resolve_reward(spec: str) -> RewardFn:
    """The reward function named by ``spec``, as the user wrote it."""
    return BUILTIN_REWARDS.get(spec) or _import_reward(spec)


def load_reward(spec: str) -> RewardFn:
    """The reward named by ``spec``, wrapped by ``checked`` so a failure names the sample."""
    return checked(resolve_reward(spec), name=spec)
