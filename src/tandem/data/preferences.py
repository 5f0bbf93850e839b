"""Preference pairs for DPO/IPO: ``{"prompt", "chosen", "rejected"}`` from JSONL or Parquet files
(read with ``datasets``), or built from the embedded arithmetic task (the right answer chosen, a
wrong one rejected), and the training batch a list of pairs becomes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tandem.config.dpo import PreferenceDataConfig
from tandem.data.batch import TrainBatch, right_padded
from tandem.data.prompts import check_jsonl
from tandem.data.reading import read_rows

Pair = dict[str, str]
"""``{"prompt": ..., "chosen": ..., "rejected": ...}``."""


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: the right one moved by 1 to 10 either way, never negative."""
    value = int(answer)
    while True:
        offset = rng.choice([d for d in range(-10, 11) if d != 0])
        if value + offset >= 0:
            return str(value + offset)


def arithmetic_pairs(items: list[dict[str, str]], rng: random.Random) -> list[Pair]:
    """A pair per arithmetic item (``prompt``/``answer``): its answer chosen, a wrong one
    rejected."""
    return [
        {
            "prompt": item["prompt"],
            "chosen": item["answer"],
            "rejected": wrong_answer(item["answer"], rng),
        }
        for item in items
    ]


def load_preference_file(path: Path, config: PreferenceDataConfig) -> list[Pair]:
    """The pairs of a JSONL or Parquet file. A malformed row stops the run with the file and the
    line (JSONL) or row (Parquet) that is wrong."""
    if not path.is_file():
        raise ValueError(f"preference file not found: {path}")
    keys = (config.prompt_key, config.chosen_key, config.rejected_key)
    if path.suffix == ".jsonl":
        hint = "set data.prompt_key / chosen_key / rejected_key to the file's column names"
        check_jsonl(path, keys, hint, strings=True)
    rows = read_rows(path)
    pairs = []
    for index, row in enumerate(rows):
        values = [row.get(key) for key in keys]
        for key, value in zip(keys, values, strict=True):
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"{path}: row {index + 1}: {key!r} must be a non-empty string (got {value!r})"
                )
        pairs.append(dict(zip(("prompt", "chosen", "rejected"), values, strict=True)))
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs


def preference_batch(source: Any, pairs: list[Pair]) -> TrainBatch:
    """Rows ``2i`` (chosen) and ``2i + 1`` (rejected) of pair ``i``: prompt, response and EOS,
    right-padded; the loss covers the response and EOS. ``source`` encodes text and knows the
    tokenizer (``PromptSource``)."""
    eos = source.tokenizer.eos_token_id
    rows = []
    for pair in pairs:
        prompt = source.encode(pair["prompt"])
        for key in ("chosen", "rejected"):
            rows.append((prompt, source.encode(pair[key]) + ([eos] if eos is not None else [])))
    return right_padded(rows, source.pad_token_id)


def load_pairs(
    config: PreferenceDataConfig, seed: int, num_train: int = 20000
) -> tuple[list[Pair], list[Pair], list[dict[str, str]]]:
    """Training pairs, held-out pairs and held-out prompts (``prompt``/``answer``, for greedy
    accuracy; the arithmetic task only, else empty)."""
    if config.task == "arithmetic":
        from tandem.data.arithmetic import ArithmeticTask

        task = ArithmeticTask(seed=seed)
        train = arithmetic_pairs(
            task.train_prompts(num_train, random.Random(seed)), random.Random(seed + 1)
        )
        prompts = task.eval_prompts(config.num_eval_pairs)
        # a fixed draw: evaluations of different runs and seeds compare the same pairs
        return train, arithmetic_pairs(prompts, random.Random(0)), prompts
    assert config.train_path is not None  # checked by PreferenceDataConfig
    train = load_preference_file(config.train_path, config)
    held_out = load_preference_file(config.eval_path, config) if config.eval_path else []
    return train, held_out[: config.num_eval_pairs], []
