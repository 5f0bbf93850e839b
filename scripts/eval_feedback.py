"""Does a model use arithmetic_feedback's hint? Greedy two-try episodes on held-out problems,
with the true hint, the flipped hint and no direction (``wrong: 17+25=``).

For each feedback: the first-try accuracy, the second-try accuracy of the problems the first
try missed, and how often the second answer moved the way the true answer lies (above or below
the first answer). A model that uses the hint does better with the true one than with the
others; one that ignores it does the same under all three.

Usage: ``python scripts/eval_feedback.py MODEL_DIR [NUM_PROBLEMS]`` (a run's ``hf`` folder, or
the embedded model ``src/tandem/assets/tiny-qwen2``); prints a markdown table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tandem.algorithms.multiturn import Episode, EpisodeLimits, run_episodes
from tandem.config.models import GenerationConfig
from tandem.data.turns import TurnEncoder
from tandem.environments.arithmetic_feedback import FEEDBACK, ArithmeticFeedbackEnv
from tandem.environments.base import InProcessEnvironments
from tandem.generation import SamplingParams, make_generator

_INTEGER = re.compile(r"-?\d+")


def _answers(episode: Episode, tokenizer: object) -> list[int | None]:
    """The integer of each model turn (None: no integer)."""
    turns: list[list[int]] = []
    for i, (token, trained) in enumerate(zip(episode.token_ids, episode.loss_mask, strict=True)):
        if trained and (i == 0 or not episode.loss_mask[i - 1]):
            turns.append([])
        if trained:
            turns[-1].append(token)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in turns]  # type: ignore[attr-defined]
    return [int(m.group()) if (m := _INTEGER.search(t)) else None for t in texts]


def main(model: Path, count: int) -> None:
    generator = make_generator(GenerationConfig(backend="hf"), model)
    encoder = TurnEncoder(generator.tokenizer)  # type: ignore[attr-defined]
    samples = ArithmeticFeedbackEnv.samples(count, seed=0, held_out=True)
    print("| feedback | first try | second try, first wrong | moved toward the answer |")
    print("|---|---|---|---|")
    for feedback in FEEDBACK:
        episodes = run_episodes(
            samples,
            1,
            generator.generate,
            InProcessEnvironments("arithmetic_feedback", {"feedback": feedback}),
            encoder,
            SamplingParams(temperature=0.0, max_tokens=6),
            EpisodeLimits(max_turns=2, max_tokens=64),
        )
        first = retried = second = toward = 0
        for episode, sample in zip(episodes, samples, strict=True):
            answer, tries = int(sample["answer"]), _answers(episode, generator.tokenizer)  # type: ignore[attr-defined]
            if tries[0] == answer:
                first += 1
                continue
            retried += 1
            second += len(tries) > 1 and tries[1] == answer
            if len(tries) > 1 and None not in tries[:2]:
                toward += (tries[1] - tries[0]) * (answer - tries[0]) > 0  # type: ignore[operator]
        print(
            f"| {feedback} | {first / count:.3f} | {second / max(1, retried):.3f} "
            f"| {toward / max(1, retried):.3f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 512)
