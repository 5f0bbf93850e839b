import random

import pytest

from tandem.data.arithmetic import ArithmeticTask, Problem
from tandem.rewards import exact_match


def _evaluate(prompt: str) -> int:
    for op in "+-*":
        a, sep, b = prompt.rstrip("=").partition(op)
        if sep and a and b:
            return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    raise AssertionError(prompt)


def test_answers_are_correct_and_format_is_plain() -> None:
    task = ArithmeticTask(seed=0, num_digits=2, ops=("+", "-", "*"), allow_negative=True)
    items = task.train_prompts(500, random.Random(0)) + task.eval_prompts(200)
    for item in items:
        assert item["prompt"].endswith("=")
        assert int(item["answer"]) == _evaluate(item["prompt"])
        assert exact_match(item["prompt"], item["answer"], item["answer"]) == 1.0
    assert any(int(i["answer"]) < 0 for i in items)


def test_splits_are_disjoint_for_every_seed() -> None:
    task = ArithmeticTask(seed=0)
    held_out = {i["prompt"] for i in task.eval_prompts(task.num_eval_problems)}
    assert 0.05 < len(held_out) / 15050 < 0.15  # ~eval_fraction of the 2-digit +/- space
    for seed in (0, 1, 2):
        train = {
            i["prompt"] for i in ArithmeticTask(seed=seed).train_prompts(5000, random.Random(seed))
        }
        assert not train & held_out
    # the split is a property of the problem, not of the seed
    assert ArithmeticTask(seed=7).eval_prompts(50) == task.eval_prompts(50)


def test_train_stream_is_seeded() -> None:
    def first(seed: int) -> list[dict[str, str]]:
        stream = ArithmeticTask(seed=seed).iter_train()
        return [next(stream) for _ in range(20)]

    assert first(3) == first(3)
    assert first(3) != first(4)
    task = ArithmeticTask()
    assert task.train_prompts(10, random.Random(5)) == task.train_prompts(10, random.Random(5))


def test_default_answers_non_negative_and_difficulty_configurable() -> None:
    items = ArithmeticTask().train_prompts(2000, random.Random(0))
    assert all(int(i["answer"]) >= 0 for i in items)
    assert {i["prompt"][2] for i in items if len(i["prompt"]) > 4} & {"+", "-"}
    one_digit = ArithmeticTask(num_digits=1, ops=("*",)).train_prompts(200, random.Random(0))
    assert all(len(i["prompt"]) == 4 and i["prompt"][1] == "*" for i in one_digit)
    three = ArithmeticTask(num_digits=3, ops=("+",)).train_prompts(200, random.Random(0))
    assert max(int(i["answer"]) for i in three) > 200


def test_sft_examples_end_with_eos() -> None:
    examples = ArithmeticTask().sft_examples(10, random.Random(0), eos_token="<|endoftext|>")
    for ex in examples:
        assert ex["completion"] == ex["answer"] + "<|endoftext|>"


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"num_digits": 0}, "num_digits"), ({"ops": ("/",)}, "ops"), ({"eval_fraction": 1.0}, "eval")],
)
def test_bad_settings_raise_value_error(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ArithmeticTask(**kwargs)  # type: ignore[arg-type]


def test_eval_prompts_too_many_raises() -> None:
    task = ArithmeticTask(num_digits=1, ops=("+",))
    with pytest.raises(ValueError, match="held-out split has"):
        task.eval_prompts(task.num_eval_problems + 1)


def test_problem_prompt() -> None:
    assert Problem(17, "+", 25).as_dict() == {"prompt": "17+25=", "answer": "42"}
