"""The ``reward`` section of a GRPO run: what scores a rollout besides the rule of
``data.reward`` — a learned reward model (``reward.model``) and an LLM judge (``reward.judge``),
each a worker of its own actor kind. A rollout's reward is the weighted sum of the parts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply with a score from 0 to "
    "10.\nScore: "
)
"""A judge prompt; ``{prompt}`` and ``{response}`` are filled in, ``{answer}`` may be used."""


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    rule_weight: float = 1.0
    """Weight of the rule reward (data.reward); 0 leaves it out of the sum (it is still logged
    as reward/rule_mean)."""
    model: Path | None = None
    """A reward model folder (AutoModelForSequenceClassification with one label, e.g. the
    export of ``tandem rm``) that scores each (prompt, response) on a worker of the
    reward_model kind; None: no reward model."""
    model_weight: float = 1.0
    """Weight of the reward model's score in a rollout's reward."""
    batch_size: int = Field(64, ge=1)
    """Sequences per forward of the reward model (and of the judge's generation)."""
    placement: Literal["colocated", "split"] = "colocated"
    """colocated: the reward model and the judge share the policy's devices and keep their
    weights on the host between their calls (GPU); split: they keep them on their device."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one scoring call of the reward model or the judge (Ray actors); past it
    the run stops naming the actor."""
    judge: Path | None = None
    """A generative model folder that grades each response (a worker of the judge kind: the
    generation backend of generation.backend); None: no judge."""
    judge_weight: float = 1.0
    """Weight of the judge's parsed score in a rollout's reward."""
    judge_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's prompt: {prompt} and {response} are filled in (both are required),
    {answer} (the dataset's reference answer) may be used."""
    judge_pattern: str = r"-?\d+(?:\.\d+)?"
    """Regular expression whose first match in the verdict is the score (group 1 if it has a
    group, else the whole match), read as a float."""
    judge_scale: float = Field(10.0, gt=0)
    """The parsed score is divided by this (a 0-10 verdict becomes 0-1)."""
    judge_unparseable: float = 0.0
    """Score of a verdict with no match (counted: reward/judge_unparseable_count)."""
    judge_max_tokens: int = Field(8, ge=1)
    """Tokens of one verdict (greedy)."""

    @model_validator(mode="after")
    def _template_slots(self) -> RewardConfig:
        import re

        missing = [slot for slot in ("{prompt}", "{response}") if slot not in self.judge_template]
        if self.judge is not None and missing:
            raise ValueError(
                f"reward.judge_template lacks {' and '.join(missing)}: the judge must see what "
                "it grades (use {prompt} and {response}; {answer} is optional)"
            )
        try:
            re.compile(self.judge_pattern)
        except re.error as err:
            raise ValueError(f"reward.judge_pattern is not a regular expression: {err}") from err
        return self

    @property
    def has_models(self) -> bool:
        """Whether any part of the reward runs on a model worker."""
        return self.model is not None or self.judge is not None
