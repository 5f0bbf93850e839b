"""Resolve ``data.reward`` (a built-in name or ``package.module:function``) to a reward."""

from __future__ import annotations

import importlib

from tandem.rewards.base import RewardFn, checked
from tandem.rewards.exact_match import exact_match
from tandem.rewards.math_answer import math_verify_reward

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math_verify": math_verify_reward,
}


def _import_reward(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"reward {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor an "
            "import path 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward {spec!r}: cannot import module {module_name!r} ({exc}); check the path and "
            "that the module is installed or on PYTHONPATH"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def resolve_reward(spec: str) -> RewardFn:
    """The reward function named by ``spec``, as the user wrote it."""
    return BUILTIN_REWARDS.get(spec) or _import_reward(spec)


def load_reward(spec: str) -> RewardFn:
    """The reward named by ``spec``, wrapped by ``checked`` so a failure names the sample."""
    return checked(resolve_reward(spec), name=spec)
