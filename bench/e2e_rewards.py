"""Rewards of the end-to-end benchmarks (``data.reward: e2e_rewards:<name>``, with ``bench/`` on
the driver's path)."""

from __future__ import annotations


def digit_fraction(prompt: str, response: str, answer: str) -> float:
    """A dense reward any model can climb: the share of the response's characters that are
    digits (0 for an empty response)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


def first_digit(prompt: str, response: str, answer: str) -> float:
    """A reward that tells apart answers of one digit each: the response's first digit over 9
    (0 without one)."""
    return next((int(c) / 9 for c in response if c.isdigit()), 0.0)
