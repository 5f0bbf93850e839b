import pytest

from tandem.rewards import RewardError, exact_match, load_reward, math_verify_reward, parse_integer


@pytest.mark.parametrize(
    ("response", "value"),
    [("42", 42), (" 42\n", 42), ("-3", -3), ("= 42", 42), ("42abc 7", 42), ("x", None), ("", None)],
)
def test_parse_integer(response: str, value: int | None) -> None:
    assert parse_integer(response) == value


def test_exact_match() -> None:
    assert exact_match("17+25=", "42", "42") == 1.0
    assert exact_match("17+25=", " 42<junk>", "42") == 1.0
    assert exact_match("17+25=", "43", "42") == 0.0
    assert exact_match("17+25=", "420", "42") == 0.0
    assert exact_match("3-6=", "-3", "-3") == 1.0
    assert exact_match("3-6=", "3", "-3") == 0.0
    assert exact_match("17+25=", "", "42") == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("so the total is 42.\n#### 42", "Natalia sold 48/2 = 24 clips.\n#### 42", 1.0),
        ("The answer is \\boxed{42}", "#### 42", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("#### 41", "#### 42", 0.0),
        ("I do not know", "#### 42", 0.0),
    ],
)
def test_math_verify(response: str, answer: str, reward: float) -> None:
    assert math_verify_reward("q", response, answer) == reward


def test_load_reward_builtins_and_import_path() -> None:
    assert load_reward("exact_match")("1+1=", "2", "2") == 1.0
    assert load_reward("math_verify")("q", "\\boxed{2}", "2") == 1.0
    fn = load_reward("tandem.rewards.exact_match:exact_match")
    assert fn("1+1=", "3", "2") == 0.0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nonsense", "neither a built-in"),
        ("no_such_module_xyz:fn", "cannot import module"),
        ("tandem.rewards.exact_match:missing", "has no attribute"),
        ("tandem.rewards.exact_match:_INTEGER", "not a function"),
    ],
)
def test_load_reward_bad_spec(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_reward(spec)


def test_failing_reward_reports_the_sample() -> None:
    fn = load_reward("exact_match")
    with pytest.raises(RewardError, match="response='2'") as info:
        fn("1+1=", "2", "two")  # a non-integer reference answer is a data error
    assert "prompt='1+1='" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def _returns_text(prompt: str, response: str, answer: str) -> str:
    return "1"


def test_non_numeric_return_is_an_error() -> None:
    fn = load_reward(f"{__name__}:_returns_text")
    with pytest.raises(RewardError, match="expected a float"):
        fn("p", "r", "a")
