"""Environments the multi-turn tests script (importable through PYTHONPATH=tests/ in actors;
only the standard library at import time)."""

from __future__ import annotations

import time


class ScriptedEnv:
    """Answers every turn with ``reply``; done after ``done_after`` turns (0: never), reward 1 on
    the turn it is done. ``fail`` = "reset" / "step" raises there; ``hang_s`` sleeps in ``step``
    when the sample's answer is "hang"."""

    def __init__(
        self, reply: str = " ok. ", done_after: int = 0, fail: str = "", hang_s: float = 0.0
    ):
        self.reply, self.done_after, self.fail, self.hang_s = reply, done_after, fail, hang_s
        self.turns = 0
        self.answer = ""

    def reset(self, sample: dict[str, str]) -> str:
        if self.fail == "reset" and sample["answer"] == "bad":
            raise RuntimeError("reset failed on purpose")
        self.answer = sample["answer"]
        return sample["prompt"]

    def step(self, response: str) -> tuple[str, float, bool]:
        self.turns += 1
        if self.fail == "step" and self.answer == "bad":
            raise RuntimeError("step failed on purpose")
        if self.answer == "hang":
            time.sleep(self.hang_s)
        done = self.done_after > 0 and self.turns >= self.done_after
        return self.reply, 1.0 if done else 0.0, done
