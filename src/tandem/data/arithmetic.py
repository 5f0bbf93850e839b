"""The embedded synthetic task: integer arithmetic prompts such as ``"17+25="`` -> ``"42"``.

Why the default is 2-digit addition and subtraction (non-negative results): the space holds
~15k distinct problems, too many for a ~1M-parameter model to memorise in a short warm start,
but the rule (digit-wise sums with a carry) is learnable by such a model. A short SFT warm start
gets part of the way (tens of percent held-out accuracy) and leaves room for GRPO to improve it
within minutes on a CPU. 1-digit problems are solved by SFT alone; 3 digits or multiplication
are too hard for the tiny model in that budget.

The held-out split is a fixed hash of the problem ``(a, op, b)``, independent of the seed, so a
held-out problem never appears in training, whatever the seed, and evaluations of different runs
are comparable. The seed only orders the training stream.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SUPPORTED_OPS = ("+", "-", "*")
_SPLIT_SALT = b"tandem-arithmetic-v1"


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem ``a op b``."""

    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        if self.op == "+":
            return str(self.a + self.b)
        if self.op == "-":
            return str(self.a - self.b)
        return str(self.a * self.b)

    def as_dict(self) -> dict[str, str]:
        return {"prompt": self.prompt, "answer": self.answer}


@dataclass
class ArithmeticTask:
    """Seeded generator of arithmetic prompts with disjoint train and held-out splits.

    Every item is a dict ``{"prompt": "17+25=", "answer": "42"}``. Operands have 1 to
    ``num_digits`` digits (uniform over ``0 .. 10**num_digits - 1``).
    """

    seed: int = 0
    """Orders the training stream (``iter_train``); the split itself does not depend on it."""
    num_digits: int = 2
    """Maximum digits of each operand."""
    ops: Sequence[str] = ("+", "-")
    """Operators, a subset of ``+ - *``."""
    eval_fraction: float = 0.1
    """Share of the problem space held out for evaluation."""
    allow_negative: bool = False
    """Allow ``a - b`` with ``b > a`` (negative answers); off by default to keep it learnable."""
    _held_out: list[Problem] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.num_digits <= 3:
            raise ValueError(f"num_digits must be in 1..3 (got {self.num_digits})")
        bad = [op for op in self.ops if op not in SUPPORTED_OPS]
        if bad or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS} (got {self.ops})")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1) (got {self.eval_fraction})")
        self.ops = tuple(dict.fromkeys(self.ops))
        held_out = [p for p in self._all_problems() if self.is_held_out(p)]
        # A fixed shuffle so eval_prompts(n) is a representative prefix, not the smallest operands.
        random.Random(0).shuffle(held_out)
        self._held_out = held_out

    @property
    def max_operand(self) -> int:
        return 10**self.num_digits - 1

    def _valid(self, problem: Problem) -> bool:
        return self.allow_negative or problem.op != "-" or problem.a >= problem.b

    def _all_problems(self) -> Iterator[Problem]:
        for op in self.ops:
            for a in range(self.max_operand + 1):
                for b in range(self.max_operand + 1):
                    problem = Problem(a, op, b)
                    if self._valid(problem):
                        yield problem

    def is_held_out(self, problem: Problem) -> bool:
        """Whether ``problem`` belongs to the held-out split (a stable hash, no RNG)."""
        digest = hashlib.blake2b(problem.prompt.encode(), key=_SPLIT_SALT, digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.eval_fraction

    @property
    def num_eval_problems(self) -> int:
        return len(self._held_out)

    def _sample_train(self, rng: random.Random) -> Problem:
        while True:  # rejection sampling: eval_fraction < 1, so this ends quickly
            problem = Problem(
                rng.randint(0, self.max_operand),
                rng.choice(self.ops),
                rng.randint(0, self.max_operand),
            )
            if self._valid(problem) and not self.is_held_out(problem):
                return problem

    def train_prompts(self, n: int, rng: random.Random) -> list[dict[str, str]]:
        """``n`` training items drawn (with replacement) from the train split using ``rng``."""
        return [self._sample_train(rng).as_dict() for _ in range(n)]

    def iter_train(self) -> Iterator[dict[str, str]]:
        """An endless stream of training items, fully determined by ``seed``."""
        rng = random.Random(self.seed)
        while True:
            yield self._sample_train(rng).as_dict()

    def eval_prompts(self, n: int) -> list[dict[str, str]]:
        """The first ``n`` held-out items: the same list on every call, for every seed."""
        if not 1 <= n <= len(self._held_out):
            raise ValueError(
                f"eval_prompts(n={n}): the held-out split has {len(self._held_out)} problems; "
                "ask for fewer or raise num_digits / eval_fraction"
            )
        return [p.as_dict() for p in self._held_out[:n]]

    def sft_examples(self, n: int, rng: random.Random, eos_token: str = "") -> list[dict[str, str]]:
        """Training items for the warm start: ``prompt``, ``answer`` and ``completion``
        (the answer followed by ``eos_token``, e.g. ``"<|endoftext|>"``, so the model learns
        to stop)."""
        items = self.train_prompts(n, rng)
        return [{**item, "completion": item["answer"] + eos_token} for item in items]
