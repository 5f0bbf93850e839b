"""The reward interface: a function of one sample, ``(prompt, response, answer) -> float``."""

from __future__ import annotations

import functools

from tandem.contracts import RewardFn


class RewardError(ValueError):
    """A reward function raised, returned a non-number or hung; the message carries the sample
    (a user's mistake: the CLI exits with status 2)."""


def clip_text(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def checked(fn: RewardFn, name: str | None = None) -> RewardFn:
    """Wrap ``fn`` so an exception names the reward and the sample instead of surfacing as a
    bare traceback from deep inside the loop, and a non-numeric return is caught early."""
    label = name or getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def wrapper(prompt: str, response: str, answer: str) -> float:
        try:
            value = fn(prompt, response, answer)
        except Exception as exc:
            raise RewardError(
                f"reward {label!r} raised {type(exc).__name__}: {exc}\n"
                f"  prompt={clip_text(prompt)!r}\n  response={clip_text(response)!r}\n"
                f"  answer={clip_text(answer)!r}"
            ) from exc
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RewardError(
                f"reward {label!r} returned {type(value).__name__} {value!r}, expected a float "
                f"(prompt={clip_text(prompt)!r}, response={clip_text(response)!r})"
            )
        return float(value)

    return wrapper
