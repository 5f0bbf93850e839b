"""Rewards: verifiers scoring one sample, ``(prompt, response, answer) -> float``."""

from tandem.rewards.base import RewardError, RewardFn, checked
from tandem.rewards.exact_match import exact_match, parse_integer
from tandem.rewards.math_answer import math_verify_reward
from tandem.rewards.registry import BUILTIN_REWARDS, load_reward, resolve_reward
from tandem.rewards.scorer import RewardScorer, Scores

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFn",
    "RewardScorer",
    "Scores",
    "checked",
    "exact_match",
    "load_reward",
    "math_verify_reward",
    "parse_integer",
    "resolve_reward",
]
