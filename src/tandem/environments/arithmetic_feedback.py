"""The embedded arithmetic task with feedback: answer a sum; when wrong, hear higher or lower
and try again.

A multi-turn task the embedded model already half-knows (held-out greedy accuracy 0.23 - 0.33
on the first try, on 128 - 512 problems): the first observation is the problem (``17+25=``,
the embedded task's format and held-out split); a correct answer (the first integer of the
turn) ends the episode with reward 1 on the first try, ``retry_penalty`` less per later try;
a wrong one gets ``higher: 17+25=`` or ``lower: 17+25=`` (the answer is higher or lower than
the guess; ``no number: ...`` when the turn had none) and the model answers again, until
``environment.max_turns`` runs out (reward 0).

``feedback`` is for measuring whether a model uses the hint: ``flipped`` says the opposite
direction, ``wrong`` says only ``wrong: 17+25=`` (``scripts/eval_feedback.py``).
"""

from __future__ import annotations

import random
import re

from tandem.data.arithmetic import ArithmeticTask

_INTEGER = re.compile(r"-?\d+")
FEEDBACK = ("direction", "flipped", "wrong")


class ArithmeticFeedbackEnv:
    """One problem. ``samples()`` rows are the embedded task's ``{"prompt", "answer"}``."""

    def __init__(
        self, retry_penalty: float = 0.5, feedback: str = "direction", num_digits: int = 2
    ):
        """``num_digits`` (the operands' digits) is for ``samples()``; a game takes its problem
        from the sample."""
        if not 0.0 <= retry_penalty <= 1.0:
            raise ValueError(
                f"arithmetic_feedback: retry_penalty must be in [0, 1] (got {retry_penalty})"
            )
        if feedback not in FEEDBACK:
            raise ValueError(f"arithmetic_feedback: feedback must be one of {FEEDBACK}")
        self.retry_penalty, self.feedback = retry_penalty, feedback
        self.prompt, self.answer, self.tries = "", 0, 0

    @staticmethod
    def samples(
        count: int, seed: int, held_out: bool = False, num_digits: int = 2, **_unused: object
    ) -> list[dict[str, str]]:
        """``count`` problems of the embedded task: its training stream (ordered by ``seed``),
        or the first ``count`` of its held-out split (the same for every seed)."""
        task = ArithmeticTask(seed=seed, num_digits=num_digits)
        if held_out:
            return task.eval_prompts(count)
        return task.train_prompts(count, random.Random(seed))

    def reset(self, sample: dict[str, str]) -> str:
        self.prompt, self.answer = sample["prompt"], int(sample["answer"])
        return self.prompt

    def step(self, response: str) -> tuple[str, float, bool]:
        self.tries += 1
        match = _INTEGER.search(response)
        if match is None:
            return f"no number: {self.prompt}", 0.0, False
        guess = int(match.group())
        if guess == self.answer:
            return "", max(0.0, 1.0 - self.retry_penalty * (self.tries - 1)), True
        if self.feedback == "wrong":
            return f"wrong: {self.prompt}", 0.0, False
        higher = (guess < self.answer) != (self.feedback == "flipped")
        return f"{'higher' if higher else 'lower'}: {self.prompt}", 0.0, False
