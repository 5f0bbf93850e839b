"""Environments for multi-turn rollouts: the interface, the registry and the shipped ones.

An environment plays the other side of an episode: ``reset(sample)`` gives the first
observation (the task), ``step(response)`` answers each model turn with the next observation
(a tool result, feedback), a reward and whether the episode ended. The episode loop that
alternates generator and environment turns is ``tandem.algorithms.multiturn``; environments run
in Ray actors (``tandem.cluster.env_pool``).
"""

from tandem.environments.base import (
    BUILTIN_ENVIRONMENTS,
    Environment,
    EnvironmentHost,
    EnvReply,
    environment_class,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "EnvReply",
    "Environment",
    "EnvironmentHost",
    "environment_class",
]
