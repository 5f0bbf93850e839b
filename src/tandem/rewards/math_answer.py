"""Math-answer reward through the ``math-verify`` package (GSM8K ``#### 42``, ``\\boxed{}``)."""

from __future__ import annotations

import threading

_GSM8K_MARKER = "####"


def _final_answer_text(text: str) -> str:
    """GSM8K solutions end with ``#### <answer>``; everything before it is working."""
    if _GSM8K_MARKER in text:
        return text.rsplit(_GSM8K_MARKER, 1)[1].strip()
    return text


def math_verify_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the reference."""
    from math_verify import parse, verify

    del prompt
    # math-verify times out through SIGALRM, which only the main thread may use (Ray actors may
    # run tasks elsewhere); off the main thread it runs without a timeout.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_final_answer_text(answer), parsing_timeout=timeout)  # type: ignore[arg-type]
    if not gold:
        raise ValueError(f"math_verify could not parse the reference answer {answer!r}")
    predicted = parse(_final_answer_text(response), parsing_timeout=timeout)  # type: ignore[arg-type]
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0
