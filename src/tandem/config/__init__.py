"""Typed configuration models and recipe loading."""

from tandem.config.dpo import DpoConfig
from tandem.config.load import ConfigError, load_config, resolve_recipe, save_resolved
from tandem.config.models import (
    AlgorithmConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    GenerationConfig,
    GrpoConfig,
    LoggingConfig,
    OptimizerConfig,
    PolicyConfig,
    RefitConfig,
    SamplingConfig,
    SftConfig,
)
from tandem.config.reward_model import RmConfig

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "DpoConfig",
    "GenerationConfig",
    "GrpoConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "RefitConfig",
    "RmConfig",
    "SamplingConfig",
    "SftConfig",
    "load_config",
    "resolve_recipe",
    "save_resolved",
]
