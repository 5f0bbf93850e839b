"""Exact-match reward for the arithmetic task: the first integer of the response."""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def parse_integer(response: str) -> int | None:
    """The first integer in ``response`` (``"-3"``, ``"= 42"``, ``"42 is it"`` all parse), or
    None when there is none."""
    match = _INTEGER.search(response.strip())
    return int(match.group()) if match else None


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1.0 when the first integer of ``response`` equals the integer ``answer``, else 0.0."""
    del prompt  # the answer alone decides
    expected = parse_integer(answer)
    if expected is None:
        raise ValueError(f"exact_match needs an integer reference answer, got {answer!r}")
    return 1.0 if parse_integer(response) == expected else 0.0
