"""Prompt sources for RL: the embedded arithmetic task, or JSONL/Parquet files via ``datasets``.

A source's data order is a pure function of (seed, step), so a resumed run sees exactly the
prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from tandem.config.models import DataConfig, EnvironmentConfig
from tandem.contracts import RewardFn
from tandem.data.reading import read_rows, text_lines


class PromptSource:
    """Prompts (``{"prompt", "answer"}`` dicts), their tokenizer and their reward."""

    def __init__(
        self,
        train: list[dict[str, str]],
        eval_items: list[dict[str, str]],
        tokenizer: Any,
        reward: RewardFn,
        seed: int,
        model_path: Path | None = None,
    ):
        if not train:
            raise ValueError("the training prompt set is empty")
        self.processor: Any = None
        """Image prompts (items with an ``image``): the model's ``VisionProcessor`` (from
        ``model_path``)."""
        if "image" in train[0]:
            from tandem.data.images import VisionProcessor

            if model_path is None:
                raise ValueError("image prompts need the model folder of their processor")
            self.processor = VisionProcessor(model_path, tokenizer)
        self.train = train
        self.eval_items = eval_items
        self.tokenizer = tokenizer
        self.reward = reward
        self.seed = seed
        self.environments: Any = None
        """Multi-turn runs: where the environments live (an ``EnvironmentRunner``, set by the
        driver); the environments give the rewards then, not ``reward``."""
        self.scorers: Any = None
        """GRPO with a reward model, a judge or a teacher: their workers
        (``cluster.scorers.ModelScorers``, set by the driver); training rewards add their
        scores to ``reward``'s, evaluations use ``reward`` alone."""
        self._order: tuple[tuple[int, int, int], np.ndarray] | None = None

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, item: dict[str, Any]) -> list[int]:
        """An item's prompt ids: with an ``image``, an ``ImagePrompt`` carrying its pixels."""
        if "image" in item:
            return self.processor(item["prompt"], [item["image"]])  # type: ignore[no-any-return]
        return self.encode(item["prompt"])

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def train_prompts(self, step: int, count: int) -> list[dict[str, str]]:
        """The ``count`` prompts of step ``step``: epochs of seeded permutations, in order."""
        out = []
        for position in range(step * count, (step + 1) * count):
            epoch, offset = divmod(position, len(self.train))
            out.append(self.train[int(self._epoch_order(epoch)[offset])])
        return out

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The seeded permutation of epoch ``epoch`` (the last one is kept: drawing it for every
        prompt cost a visible share of the embedded task's step; figures:
        docs/benchmarks/2026-12-04-cpu-e2e.md). It depends on the seed, the epoch and the
        number of items only, which key it."""
        key = (self.seed, epoch, len(self.train))
        if self._order is None or self._order[0] != key:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.train))
            self._order = (key, order)
        return self._order[1]

    def refill_prompts(self, step: int, round_index: int, count: int) -> list[dict[str, str]]:
        """``count`` more prompts for step ``step``'s refill round ``round_index`` (dynamic
        sampling): a seeded draw of its own, the same after a resume."""
        rng = np.random.default_rng([self.seed, step, round_index, 1])
        picks = rng.choice(len(self.train), size=count, replace=count > len(self.train))
        return [self.train[int(i)] for i in picks]

    def eval_prompts(self, count: int) -> list[dict[str, str]]:
        return self.eval_items[:count]

    def longest_prompts(self, count: int = 64) -> list[int]:
        """Token lengths of the ``count`` longest prompts (by characters) of either set."""
        texts = sorted({item["prompt"] for item in self.train + self.eval_items}, key=len)
        return [len(self.encode(text)) for text in texts[-count:]]


def make_prompt_source(
    config: DataConfig,
    model_path: Path,
    reward: RewardFn,
    seed: int,
    num_train: int = 20000,
    environment: EnvironmentConfig | None = None,
) -> PromptSource:
    train, eval_items = load_prompt_items(config, seed, num_train, environment)
    return PromptSource(train, eval_items, load_tokenizer(model_path), reward, seed, model_path)


def load_prompt_items(
    config: DataConfig,
    seed: int,
    num_train: int = 20000,
    environment: EnvironmentConfig | None = None,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The training and held-out prompts of ``config`` (the embedded task's, the environment's,
    or a file's, read and checked row by row)."""
    if config.task == "environment":
        assert environment is not None  # checked by GrpoConfig
        return environment_samples(environment, seed, num_train, config.num_eval_prompts)
    if config.task == "visual":
        from tandem.data.visual import cached_visual_task

        folder = cached_visual_task(config.num_eval_prompts, seed)
        image_data = config.model_copy(update={"image_key": config.image_key or "image"})
        train = load_prompt_file(folder / "train.jsonl", image_data)
        return train, load_prompt_file(folder / "eval.jsonl", image_data)
    if config.task == "arithmetic":
        from tandem.data.arithmetic import ArithmeticTask

        task = ArithmeticTask(seed=seed)
        return task.train_prompts(num_train, random.Random(seed)), task.eval_prompts(
            config.num_eval_prompts
        )
    assert config.train_path is not None  # checked by DataConfig
    train = load_prompt_file(config.train_path, config)
    return train, load_prompt_file(config.eval_path, config) if config.eval_path else train


def load_tokenizer(model_path: Path) -> Any:
    """The model's tokenizer (importing transformers takes seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def environment_samples(
    environment: EnvironmentConfig, seed: int, num_train: int, num_eval: int
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Training and held-out samples from the environment class's ``samples``."""
    from tandem.environments.base import environment_class

    cls = environment_class(environment.name)
    samples = getattr(cls, "samples", None)
    if samples is None:
        raise ValueError(
            f"data.task is 'environment' but environment {environment.name!r} has no samples() "
            "method; use data.task: jsonl with prompt and answer columns instead"
        )
    train = samples(num_train, seed, held_out=False, **environment.kwargs)
    eval_items = samples(num_eval, seed, held_out=True, **environment.kwargs)
    return list(train), list(eval_items)


def load_prompt_file(path: Path, config: DataConfig) -> list[dict[str, str]]:
    """Rows of a JSONL or Parquet file as ``{"prompt", "answer"}`` with the prompt template
    applied. A malformed row stops the run with the file and line (row) that is wrong."""
    if not path.is_file():
        raise ValueError(f"data file not found: {path}")
    if not path.read_bytes().strip():
        raise ValueError(f"data file {path} is empty")
    image_key = config.image_key
    if path.suffix == ".jsonl":
        check_jsonl(
            path, (config.prompt_key, config.answer_key, *([image_key] if image_key else []))
        )
    rows = read_rows(path)
    if image_key is not None:
        from tandem.data.images import decode_image  # imports torch: not for text prompts

        rows = image_column(rows, path, image_key)
    items: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        for key in (config.prompt_key, config.answer_key):
            if row.get(key) is None:
                raise ValueError(f"{path}: row {index + 1} has no {key!r}")
        try:
            prompt = config.prompt_template.format(**{**row, "question": row[config.prompt_key]})
        except KeyError as err:
            raise ValueError(
                f"data.prompt_template uses {err} but {path} row {index + 1} has no such column"
            ) from None
        except (ValueError, IndexError) as err:  # "{0}", "{question", a stray "}"
            raise ValueError(
                f"data.prompt_template={config.prompt_template!r} is not a template of named "
                f"columns like '{{question}}' ({err}; write a literal brace as '{{{{')"
            ) from None
        item = {"prompt": prompt, "answer": str(row[config.answer_key])}
        if image_key is not None:
            item["image"] = decode_image(row[image_key], f"{path} row {index + 1}")
        items.append(item)
    return items


def image_column(rows: Any, path: Path, key: str) -> Any:
    """``rows`` with column ``key`` cast to ``datasets.Image`` (undecoded: each row is decoded
    and checked on its own, so a bad one is named), relative paths taken from ``path``'s
    folder."""
    import datasets

    if key not in rows.column_names:
        raise ValueError(
            f"{path} has no column {key!r} (data.image_key; columns: {rows.column_names})"
        )

    def absolute(row: dict[str, Any]) -> dict[str, Any]:
        value = row[key]
        if isinstance(value, str) and not Path(value).is_absolute():
            value = str(path.parent / value)
        return {key: value}

    if rows.features[key].dtype == "string":
        rows = rows.map(absolute)
    return rows.cast_column(key, datasets.Image(decode=False))


def check_jsonl(
    path: Path,
    required: tuple[str, ...],
    key_hint: str = "set data.prompt_key / data.answer_key to the file's column names",
    strings: bool = False,
) -> None:
    """Every non-empty line of ``path`` is a JSON object with the ``required`` keys (with
    ``strings``: each a non-empty string); the first that is not stops the run naming
    ``path:line``."""
    for line_number, line in enumerate(text_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number}: expected a JSON object per line")
        missing = [key for key in required if key not in row]
        if missing:
            raise ValueError(f"{path}:{line_number}: missing key(s) {missing} ({key_hint})")
        for key in required if strings else ():
            if not isinstance(row[key], str) or not row[key]:
                raise ValueError(
                    f"{path}:{line_number}: {key!r} must be a non-empty string (got {row[key]!r})"
                )
