"""The config of ``tandem dpo``: DPO / IPO on preference pairs (and the pairs' data section,
which ``tandem rm`` reads too)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tandem.config.lora import check_lora_generation
from tandem.config.models import (
    CheckpointConfig,
    ClusterConfig,
    GenerationConfig,
    LoggingConfig,
    PolicyConfig,
    Section,
)


class DpoAlgorithmConfig(Section):
    num_steps: int = Field(100, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(32, ge=1)
    """Preference pairs per optimizer step (twice as many sequences)."""
    loss: Literal["dpo", "ipo"] = "dpo"
    """dpo: -log sigmoid(beta * margin) (Rafailov et al. 2023); ipo: (margin - 1 / (2 beta))^2
    (Azar et al. 2023). margin = (log pi - log ref)(chosen) - (log pi - log ref)(rejected), with
    log pi a response's summed token logprobs."""
    beta: float = Field(0.1, gt=0)
    """Strength of the pull to the frozen reference (DPO's beta; IPO's tau)."""
    nll_coef: float = Field(0.0, ge=0)
    """Adds nll_coef x the chosen response's negative log-likelihood (its summed token
    logprobs, per pair) to the loss, so the chosen answers stay likely while the margins grow
    (RPO, Pang et al. 2024); 0 disables."""
    eval_every: int = Field(20, ge=0)
    """Evaluate held-out preference accuracy (and, on the arithmetic task, greedy accuracy)
    every K steps and at the end; 0 disables."""
    seed: int = 0
    """Seed of data order, of the synthetic pairs and of initialisation."""


class PreferenceDataConfig(Section):
    task: Literal["arithmetic", "file"] = "arithmetic"
    """arithmetic: pairs from the embedded task (the right answer chosen, a wrong one
    rejected); file: pairs from train_path (JSONL or Parquet)."""
    train_path: Path | None = None
    """JSONL/Parquet file of training pairs (task=file)."""
    eval_path: Path | None = None
    """JSONL/Parquet file of held-out pairs (task=file); None: no held-out pairs."""
    prompt_key: str = "prompt"
    """Column holding the prompt."""
    chosen_key: str = "chosen"
    """Column holding the preferred response."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response."""
    num_eval_pairs: int = Field(64, ge=1)
    """Held-out pairs (and, on the arithmetic task, held-out prompts) per evaluation."""

    @model_validator(mode="after")
    def _path_for_file(self) -> PreferenceDataConfig:
        if self.task == "file" and self.train_path is None:
            raise ValueError("data.train_path is required when data.task is 'file'")
        return self


class DpoConfig(Section):
    """A whole DPO (or IPO) run."""

    cluster: ClusterConfig = ClusterConfig()
    policy: PolicyConfig = PolicyConfig()
    algorithm: DpoAlgorithmConfig = DpoAlgorithmConfig()
    generation: GenerationConfig = GenerationConfig()
    """Generator of the held-out greedy evaluation (arithmetic task; refit before each)."""
    data: PreferenceDataConfig = PreferenceDataConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    output_dir: Path | None = None
    """Also export the final policy as a Hugging Face folder here."""

    @model_validator(mode="after")
    def _lora_generators(self) -> DpoConfig:
        self.generation = check_lora_generation(self.policy.lora, self.generation)
        return self
