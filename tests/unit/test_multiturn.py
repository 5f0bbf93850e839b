"""Multi-turn episodes in one process: the HF generator, in-process environments, the trainer.

Masks, budgets and environment errors of ``run_episodes``; the trainer's logprobs of the
concatenated sequences equal the generator's on every generated token; chat-template turns
concatenate to the template's own rendering of the conversation."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.algorithms.multiturn import (
    Episode,
    EpisodeLimits,
    episode_metrics,
    episode_rollout,
    run_episodes,
)
from tandem.algorithms.rollouts import rollouts_to_batch
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.models import GenerationConfig, PolicyConfig
from tandem.data.arithmetic import ArithmeticTask
from tandem.data.batch import TrainBatch
from tandem.data.turns import TurnEncoder
from tandem.environments.arithmetic_feedback import ArithmeticFeedbackEnv
from tandem.environments.base import InProcessEnvironments
from tandem.environments.calculator import CalculatorEnv, evaluate_expression
from tandem.environments.guess_number import GuessNumberEnv
from tandem.generation import SamplingParams, make_generator
from tandem.generation.hf_generator import HfGenerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: scripted_envs
SCRIPTED = "scripted_envs:ScriptedEnv"
SAMPLES = [{"prompt": "17+25=", "answer": "a"}, {"prompt": "3-1=", "answer": "b"}]
PARAMS = SamplingParams(temperature=1.0, max_tokens=5, seed=3)


@pytest.fixture(scope="module")
def generator() -> HfGenerator:
    gen = make_generator(GenerationConfig(backend="hf"), DEFAULT_MODEL_DIR)
    assert isinstance(gen, HfGenerator)
    return gen


def episodes(
    generator: HfGenerator,
    env_kwargs: dict[str, Any],
    samples: list[dict[str, str]] = SAMPLES,
    max_turns: int = 3,
    max_tokens: int = 200,
    n: int = 2,
) -> list[Episode]:
    return run_episodes(
        samples,
        n,
        generator.generate,
        InProcessEnvironments(SCRIPTED, env_kwargs),
        TurnEncoder(generator.tokenizer),
        PARAMS,
        EpisodeLimits(max_turns=max_turns, max_tokens=max_tokens),
    )


def episodes_to_batch(eps: list[Episode], pad_token_id: int) -> TrainBatch:
    return rollouts_to_batch([episode_rollout(e, pad_token_id) for e in eps], pad_token_id)


def spans(episode: Episode) -> list[tuple[int, list[int]]]:
    """Runs of equal mask value: [(mask, tokens), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(episode.token_ids, episode.loss_mask, strict=True):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


def test_turns_alternate_and_only_generated_tokens_are_trained(generator: HfGenerator) -> None:
    reply = " ok. "
    eps = episodes(generator, {"reply": reply, "done_after": 0}, max_turns=3)
    encode = generator.tokenizer.encode
    assert [e.sample_index for e in eps] == [0, 0, 1, 1]
    for episode in eps:
        prompt = encode(SAMPLES[episode.sample_index]["prompt"], add_special_tokens=False)
        runs = spans(episode)
        # prompt, then model / environment turns alternating; the last model turn hits the
        # turn budget, so no observation follows it
        assert runs[0] == (0, prompt)
        assert [m for m, _ in runs] == [0, 1, 0, 1, 0, 1]
        assert all(t == encode(reply, add_special_tokens=False) for m, t in runs[1:] if m == 0)
        assert episode.num_turns == 3 and episode.end == "turns" and episode.reward == 0
        generated = [lp for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if m]
        assert all(lp < 0 for lp in generated)
        assert all(
            lp == 0 for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if not m
        )
    batch = episodes_to_batch(eps, pad_token_id=0)
    for row, episode in enumerate(eps):
        n = len(episode.token_ids)
        assert batch.loss_mask[row, :n].tolist() == episode.loss_mask
        assert batch.loss_mask[row, n:].sum() == 0 and batch.attention_mask[row].sum() == n


def test_trainer_logprobs_equal_the_generators_on_every_turn(generator: HfGenerator) -> None:
    from tandem.trainer import PolicyTrainer

    eps = episodes(generator, {"done_after": 0}, max_turns=3)
    batch = episodes_to_batch(eps, pad_token_id=generator.tokenizer.eos_token_id)
    trainer = PolicyTrainer(PolicyConfig(model_path=DEFAULT_MODEL_DIR))
    trained = trainer.logprobs(batch)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 3 * len(eps)  # several turns of generated tokens each
    assert batch.generator_logprobs is not None
    torch.testing.assert_close(trained[mask], batch.generator_logprobs[mask], atol=1e-4, rtol=0)


def test_environment_done_ends_the_episode_with_its_reward(generator: HfGenerator) -> None:
    eps = episodes(generator, {"done_after": 2}, max_turns=5)
    assert all(e.end == "env" and e.num_turns == 2 and e.reward == 1.0 for e in eps)
    assert [m for m, _ in spans(eps[0])] == [0, 1, 0, 1]  # nothing after the last turn


def test_token_budget_cuts_the_episode(generator: HfGenerator) -> None:
    eps = episodes(generator, {"reply": " a longer reply. "}, max_turns=50, max_tokens=40)
    assert all(len(e.token_ids) <= 40 and e.end == "tokens" for e in eps)
    metrics = episode_metrics(eps)
    assert metrics["env/end_tokens_frac"] == 1.0 and metrics["env/errors"] == 0


def test_a_failing_environment_ends_only_its_episodes(generator: HfGenerator) -> None:
    samples = [*SAMPLES, {"prompt": "5+5=", "answer": "bad"}]
    for fail in ("reset", "step"):
        eps = episodes(generator, {"done_after": 2, "fail": fail}, samples=samples)
        bad, good = eps[4:], eps[:4]
        assert all(e.end == "error" and fail in (e.error or "") for e in bad)
        assert all(e.end == "env" and e.reward == 1.0 for e in good)
        assert episode_metrics(eps)["env/errors"] == 2
        if fail == "reset":
            assert all(e.token_ids == [] for e in bad)
    # an episode whose reset failed has no tokens: the batch still builds
    assert episodes_to_batch(eps, pad_token_id=0).num_sequences == 6


CHAT = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.mark.parametrize("stopped_on_eos", [True, False])
def test_chat_turns_concatenate_to_the_templates_rendering(stopped_on_eos: bool) -> None:
    from transformers import AutoTokenizer

    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)))
    tokenizer.chat_template = CHAT
    encoder = TurnEncoder(tokenizer)
    assert encoder.chat
    reply = tokenizer.encode("42", add_special_tokens=False)
    if stopped_on_eos:
        reply.append(tokenizer.eos_token_id)
    ids = encoder.first("17+25=") + reply + encoder.next("lower", reply[-1])
    conversation = [
        {"role": "user", "content": "17+25="},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "lower"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert not TurnEncoder(tokenizer, chat_template=False).chat


def test_guess_number_and_calculator_rules() -> None:
    game = GuessNumberEnv(low=1, high=8)
    assert game.reset({"prompt": "Guess 1-8: ", "answer": "5"}) == "Guess 1-8: "
    assert game.step("3") == (" higher. Guess: ", 0.0, False)
    assert game.step("x") == (" no number. Guess: ", 0.0, False)
    assert game.step("7") == (" lower. Guess: ", 0.0, False)
    _, reward, done = game.step("5")
    assert done and reward == pytest.approx(0.7)
    rows = GuessNumberEnv.samples(50, seed=1)
    assert {int(r["answer"]) for r in rows} <= set(range(1, 9)) and len(
        {r["answer"] for r in rows}
    ) > 4
    assert (
        rows
        == GuessNumberEnv.samples(50, seed=1)
        != GuessNumberEnv.samples(50, seed=1, held_out=True)
    )

    calc = CalculatorEnv()
    calc.reset({"prompt": "12*34+56=", "answer": "464"})
    assert calc.step("<calc>12*34") == ("<result>408</result>", 0.0, False)
    assert calc.step("<calc>__import__('os')") == ("<result>error: ValueError</result>", 0.0, False)
    assert calc.step("464") == ("", 1.0, True)
    assert evaluate_expression("2+3*(4-1)") == 11
    for row in CalculatorEnv.samples(20, seed=0):
        assert str(evaluate_expression(row["prompt"].rstrip("="))) == row["answer"]


def test_arithmetic_feedback_rules() -> None:
    env = ArithmeticFeedbackEnv(retry_penalty=0.25)
    assert env.reset({"prompt": "17+25=", "answer": "42"}) == "17+25="
    assert env.step("40") == ("higher: 17+25=", 0.0, False)
    assert env.step("x") == ("no number: 17+25=", 0.0, False)
    assert env.step("50<|endoftext|>") == ("lower: 17+25=", 0.0, False)
    _, reward, done = env.step("42<|endoftext|>")
    assert done and reward == pytest.approx(0.25)
    first = ArithmeticFeedbackEnv()
    first.reset({"prompt": "3-1=", "answer": "2"})
    assert first.step("2") == ("", 1.0, True)
    with pytest.raises(ValueError, match="retry_penalty"):
        ArithmeticFeedbackEnv(retry_penalty=2.0)
    for feedback, hint in (("flipped", "lower: 3-1="), ("wrong", "wrong: 3-1=")):
        control = ArithmeticFeedbackEnv(feedback=feedback)
        control.reset({"prompt": "3-1=", "answer": "2"})
        assert control.step("1") == (hint, 0.0, False)
    with pytest.raises(ValueError, match="feedback"):
        ArithmeticFeedbackEnv(feedback="maybe")
    # the embedded task's splits: training rows never held out; held-out rows fixed by the task
    task = ArithmeticTask()
    train = ArithmeticFeedbackEnv.samples(200, seed=1)
    assert (
        train
        == ArithmeticFeedbackEnv.samples(200, seed=1)
        != ArithmeticFeedbackEnv.samples(200, seed=2)
    )
    assert not set(r["prompt"] for r in train) & set(r["prompt"] for r in task.eval_prompts(500))
    for seed in (0, 5):
        assert ArithmeticFeedbackEnv.samples(16, seed, held_out=True) == task.eval_prompts(16)


def test_the_shipped_environments_play_episodes(generator: HfGenerator) -> None:
    shipped = {
        "calculator": (CalculatorEnv, ("</calc>",)),
        "guess_number": (GuessNumberEnv, ()),
        "arithmetic_feedback": (ArithmeticFeedbackEnv, ()),
    }
    for name, (cls, stop) in shipped.items():
        eps = run_episodes(
            cls.samples(3, seed=0),
            2,
            generator.generate,
            InProcessEnvironments(name),
            TurnEncoder(generator.tokenizer),
            SamplingParams(temperature=1.0, max_tokens=8, stop=stop, seed=0),
            EpisodeLimits(max_turns=3, max_tokens=100),
        )
        assert len(eps) == 6 and all(e.error is None and e.num_turns >= 1 for e in eps)
        assert all(e.end in ("env", "turns", "tokens") for e in eps)
