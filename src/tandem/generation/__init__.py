"""Generators: the rollout engines (vLLM, transformers) behind one interface.

Importing this package never imports vllm; ``make_generator`` does, only for the vllm backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tandem.generation.base import Generator, Rollout, SamplingParams, group_rollouts

if TYPE_CHECKING:
    from tandem.config.models import GenerationConfig


def make_generator(
    config: GenerationConfig, model_path: str | Path, device: str = "cpu", dtype: str = "float32"
) -> Generator:
    """The generator ``config.backend`` names (``auto`` decided for this machine), loaded from
    the Hugging Face folder."""
    from tandem.machine import generator_backend

    backend = generator_backend(config)
    if backend == "hf":
        from tandem.generation.hf_generator import HfGenerator

        return HfGenerator(
            model_path,
            device=device,
            dtype=dtype,
            sleep_level=config.sleep_level,
            compile_layers=bool(config.compile) and device != "cpu",
        )
    if config.compile:  # backend auto, decided for vLLM on this machine
        from tandem.config.load import ConfigError
        from tandem.config.models import COMPILE_NEEDS_HF

        raise ConfigError(COMPILE_NEEDS_HF)
    if backend == "vllm":
        from tandem.generation.vllm_generator import VllmGenerator

        return VllmGenerator(model_path, config, dtype=dtype)
    raise ValueError(f"generation.backend must be 'vllm' or 'hf' (got {config.backend!r})")


__all__ = ["Generator", "Rollout", "SamplingParams", "group_rollouts", "make_generator"]
