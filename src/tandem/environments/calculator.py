"""A calculator tool on multi-step arithmetic.

The task is an expression such as ``12*34+56``. In a turn the model either calls the tool,
``<calc>12*34</calc>`` (generation stops after ``</calc>``), and the environment answers
``<result>408</result>``, or gives its final answer (a turn with no tool call), which ends the
episode with reward 1 if it equals the expression's value. Tool calls are free; the turn budget
(``environment.max_turns``) bounds them.
"""

from __future__ import annotations

import ast
import operator
import random
import re

_CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)
_INTEGER = re.compile(r"-?\d+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
STOP = "</calc>"
"""The stop string a calculator recipe generates with: a tool call ends the model's turn."""


def evaluate_expression(text: str) -> int:
    """The value of an integer expression of ``+ - *`` and parentheses (nothing else runs)."""
    node = ast.parse(text.strip(), mode="eval").body
    return _evaluate(node)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if abs(left) > 10**12 or abs(right) > 10**12:
            raise ValueError("operand too large")
        return int(_OPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")


class CalculatorEnv:
    """One problem; the tool is the only way to see intermediate values."""

    def __init__(self, max_operand: int = 99):
        self.max_operand = max_operand
        self.answer = 0

    @staticmethod
    def samples(
        count: int, seed: int, held_out: bool = False, max_operand: int = 99, **_unused: object
    ) -> list[dict[str, str]]:
        """``a*b+c`` / ``a*b-c`` / ``a+b*c`` problems (two steps each), seeded."""
        rng = random.Random(f"calculator-{seed}-{held_out}")
        rows = []
        for _ in range(count):
            a, b, c = (rng.randint(2, max_operand) for _ in range(3))
            expr = rng.choice((f"{a}*{b}+{c}", f"{a}*{b}-{c}", f"{a}+{b}*{c}"))
            rows.append({"prompt": f"{expr}=", "answer": str(evaluate_expression(expr))})
        return rows

    def reset(self, sample: dict[str, str]) -> str:
        self.answer = int(sample["answer"])
        return sample["prompt"]

    def step(self, response: str) -> tuple[str, float, bool]:
        call = _CALL.search(response)
        if call is not None:
            try:
                result = str(evaluate_expression(call.group(1)))
            except (SyntaxError, ValueError, ZeroDivisionError) as err:
                result = f"error: {type(err).__name__}"
            return f"<result>{result}</result>", 0.0, False
        match = _INTEGER.search(response)
        correct = match is not None and int(match.group()) == self.answer
        return "", 1.0 if correct else 0.0, True
