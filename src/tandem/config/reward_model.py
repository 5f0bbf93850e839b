"""The config of ``tandem rm``: Bradley-Terry training of a reward model on preference pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.dpo import PreferenceDataConfig
from tandem.config.models import CheckpointConfig, LoggingConfig, OptimizerConfig, Section


class RewardModelConfig(Section):
    model_path: Path = DEFAULT_MODEL_DIR
    """Hugging Face folder to start from: a causal LM (its decoder gets a fresh one-label
    score head: AutoModelForSequenceClassification) or a reward model to train further.
    Default: the embedded tiny model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where it trains; auto: the first CUDA device when there is one, else the CPU."""
    threads: int | None = Field(None, ge=1)
    """torch's CPU threads; None: torch's default (every core). A small model on a busy machine
    trains far faster on one: OpenMP threads that wait for a core at every barrier cost more
    than they compute."""
    max_length: int = Field(1024, ge=2)
    """Tokens of prompt + response kept (the end: the score is read at the last token)."""
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-3, warmup_steps=20)
    """AdamW and learning-rate schedule."""
    trainable_layers: int | None = Field(None, ge=1)
    """Train only the last N decoder layers (with the final norm and the score head); the
    layers below stay as the causal LM learned them. None: every parameter."""
    unfreeze_after: int | None = Field(None, ge=0)
    """With trainable_layers: every parameter trains after this many steps (a fresh AdamW at
    unfreeze_lr, its warm-up and schedule over the steps left). None: the top layers only."""
    unfreeze_lr: float | None = Field(None, gt=0)
    """Learning rate once every parameter trains; None: optimizer.lr."""
    score_init: Literal["random", "zero"] = "random"
    """How a fresh score head starts (model_path a causal LM): random (transformers' draw) or
    zero (every score 0 at first, so the backbone gets no gradient until the head has learned
    a direction, not a random one's). A reward model's own head is kept either way."""

    @model_validator(mode="after")
    def _unfreeze_needs_frozen_layers(self) -> RewardModelConfig:
        if self.unfreeze_after is not None and self.trainable_layers is None:
            raise ValueError(
                "model.unfreeze_after needs model.trainable_layers (without it every parameter "
                "trains from the start)"
            )
        return self


class RmAlgorithmConfig(Section):
    num_steps: int = Field(600, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(64, ge=1)
    """Preference pairs per optimizer step."""
    eval_every: int = Field(100, ge=0)
    """Evaluate held-out pair accuracy every K steps and at the end; 0 disables."""
    seed: int = 0
    """Seed of data order, of the synthetic pairs and of the score head's initialisation."""
    chosen_lm_coef: float = Field(0.0, ge=0)
    """Weight of an auxiliary language-modelling loss added to the Bradley-Terry loss: the mean
    next-token cross-entropy of the chosen response's tokens, read from the decoder's last
    hidden states through its input embeddings (a model with tied word embeddings). It keeps
    the backbone computing the right answer where the score is read. 0: Bradley-Terry alone."""


class RmConfig(Section):
    """A whole reward-model run (``tandem rm``)."""

    model: RewardModelConfig = RewardModelConfig()
    algorithm: RmAlgorithmConfig = RmAlgorithmConfig()
    data: PreferenceDataConfig = PreferenceDataConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    output_dir: Path | None = None
    """Also export the trained reward model (AutoModelForSequenceClassification) here."""
