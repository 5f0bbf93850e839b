"""Guess the number: the model guesses, the environment says higher or lower.

A multi-turn task with feedback: a secret integer in ``[low, high]``; each model turn is a
guess (the first integer in the response), each environment turn says whether the secret is
higher or lower. The reward is 1 for finding it (less ``turn_penalty`` per extra guess), 0 when
the turns run out; a response with no integer, or one outside the range, is a wasted turn.
Optimal play (bisection) finds a secret in 1..8 within 3 guesses.
"""

from __future__ import annotations

import random
import re

_INTEGER = re.compile(r"-?\d+")


class GuessNumberEnv:
    """One game. ``samples()`` rows carry the secret in ``answer``."""

    def __init__(self, low: int = 1, high: int = 8, turn_penalty: float = 0.1):
        if low >= high:
            raise ValueError(f"guess_number: low ({low}) must be below high ({high})")
        self.low, self.high, self.turn_penalty = low, high, turn_penalty
        self.secret = low
        self.guesses = 0

    @staticmethod
    def samples(
        count: int,
        seed: int,
        held_out: bool = False,
        low: int = 1,
        high: int = 8,
        **_unused: object,
    ) -> list[dict[str, str]]:
        """``count`` games with seeded secrets (a different stream for the held-out games)."""
        rng = random.Random(f"guess_number-{seed}-{held_out}")
        prompt = f"Guess {low}-{high}: "
        return [{"prompt": prompt, "answer": str(rng.randint(low, high))} for _ in range(count)]

    def reset(self, sample: dict[str, str]) -> str:
        self.secret = int(sample["answer"])
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} outside [{self.low}, {self.high}]")
        return sample["prompt"]

    def step(self, response: str) -> tuple[str, float, bool]:
        self.guesses += 1
        match = _INTEGER.search(response)
        if match is None:
            return " no number. Guess: ", 0.0, False
        guess = int(match.group())
        if guess == self.secret:
            return "", max(0.0, 1.0 - self.turn_penalty * (self.guesses - 1)), True
        hint = "higher" if guess < self.secret else "lower"
        return f" {hint}. Guess: ", 0.0, False
