"""The ``policy.backend`` choice and the ``policy.megatron`` section (the Megatron-core trainer),
and the policy settings that backend refuses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TrainerBackend = Literal["fsdp2", "megatron"]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
"""Decoders whose layout ``megatron_weights`` converts (RMSNorm, rotary positions, SwiGLU MLP,
grouped-query attention; Qwen2 with q/k/v biases)."""


def hf_value(hf: Any, key: str, default: Any = None) -> Any:
    """``key`` of a transformers config or of its config.json as a dict."""
    if isinstance(hf, dict):
        return hf.get(key, default)
    return getattr(hf, key, default)


def rope(hf: Any) -> tuple[float, str]:
    """(rotary base, rope type) of ``hf``: transformers 5 keeps them in ``rope_parameters``,
    older configs in ``rope_theta`` / ``rope_scaling``."""
    params = hf_value(hf, "rope_parameters") or {}
    scaling = hf_value(hf, "rope_scaling") or {}
    theta = params.get("rope_theta", hf_value(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


def qkv_bias(hf: Any) -> bool:
    """Whether the q/k/v projections carry biases (Qwen2 always, Llama with attention_bias)."""
    return hf_value(hf, "model_type") == "qwen2" or bool(hf_value(hf, "attention_bias", False))


def unsupported(hf: Any) -> list[str]:
    """What keeps ``hf`` from running on the Megatron-core trainer, each as a sentence ([] if
    nothing)."""
    model_type = hf_value(hf, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return [f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"]
    problems = []
    if hf_value(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf_value(hf, 'hidden_act')!r} (SwiGLU needs silu)")
    if rope(hf)[1] != "default":
        problems.append(f"rope type {rope(hf)[1]!r} (plain rotary embeddings only)")
    if model_type == "llama" and hf_value(hf, "attention_bias", False):
        problems.append("attention_bias (an o_proj bias has no Megatron counterpart here)")
    if hf_value(hf, "mlp_bias", False):
        problems.append("mlp_bias")
    if hf_value(hf, "use_sliding_window", False):
        problems.append("use_sliding_window (full attention only)")
    return problems


class MegatronConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks each layer's matrices are split over (Megatron tensor parallelism); must divide
    the attention heads and the MLP width. The data-parallel size is cluster.num_trainers /
    (tensor_parallel_size * pipeline_parallel_size)."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Stages the layers are cut into (Megatron pipeline parallelism)."""
    vocab_divisible_by: int = Field(128, ge=1)
    """The embedding and output layer are padded to a multiple of this times
    tensor_parallel_size rows; the padded logits are masked out of every log-softmax."""


def data_parallel_ranks(world_size: int, tensor_parallel: int, pipeline_parallel: int) -> list[int]:
    """The data-parallel rank of every trainer rank under Megatron's default order
    (tensor-parallel ranks adjacent, then data-parallel, pipeline stages outermost): the ranks
    that share one entry take the same shard of a batch, and return the same logprobs."""
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise ValueError(
            f"cluster.num_trainers={world_size} does not divide into "
            f"policy.megatron.tensor_parallel_size x pipeline_parallel_size = "
            f"{tensor_parallel} x {pipeline_parallel}: set num_trainers to a multiple of it"
        )
    data_parallel = world_size // model_parallel
    return [(rank // tensor_parallel) % data_parallel for rank in range(world_size)]


def check_megatron_policy(policy: Any) -> None:
    """``policy`` (a ``PolicyConfig``; not imported, ``config.models`` imports this module) with
    backend=megatron and a setting only the FSDP2 trainer has is an error naming the setting."""
    if policy.backend != "megatron":
        return
    refused = [
        (policy.lora is not None, "policy.lora (LoRA trains on policy.backend=fsdp2)"),
        (policy.cpu_offload, "policy.cpu_offload=true (an FSDP2 policy)"),
        (not policy.offload_weights, "policy.offload_weights=false (an FSDP2 policy)"),
        (policy.compile, "policy.compile=true (the FSDP2 trainer's decoder layers)"),
        (policy.packing, "policy.packing=true (the Megatron trainer takes padded batches)"),
        (
            policy.optimizer.bf16_stochastic_round,
            "policy.optimizer.bf16_stochastic_round=true (Megatron's optimizer keeps fp32 main "
            "weights)",
        ),
    ]
    found = [what for bad, what in refused if bad]
    if found:
        raise ValueError("policy.backend=megatron does not take " + "; ".join(found))
