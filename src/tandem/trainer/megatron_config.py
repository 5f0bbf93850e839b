"""Megatron-core's model settings from a Hugging Face Qwen2/Llama config: the keyword arguments
of ``TransformerConfig`` and of ``GPTModel`` (pure functions, no megatron import), and what
keeps a model from converting. ``hf`` is a transformers config or its config.json as a dict."""

from __future__ import annotations

from typing import Any

from tandem.trainer.megatron_weights import DecoderShape

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
"""Decoders whose layout ``megatron_weights`` converts (RMSNorm, rotary positions, SwiGLU MLP,
grouped-query attention; Qwen2 with q/k/v biases)."""


def _get(hf: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf, dict):
        return hf.get(key, default)
    return getattr(hf, key, default)


def rope(hf: Any) -> tuple[float, str]:
    """(rotary base, rope type) of ``hf``: transformers 5 keeps them in ``rope_parameters``,
    older configs in ``rope_theta`` / ``rope_scaling``."""
    params = _get(hf, "rope_parameters") or {}
    scaling = _get(hf, "rope_scaling") or {}
    theta = params.get("rope_theta", _get(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


def qkv_bias(hf: Any) -> bool:
    """Whether the q/k/v projections carry biases (Qwen2 always, Llama with attention_bias)."""
    return _get(hf, "model_type") == "qwen2" or bool(_get(hf, "attention_bias", False))


def unsupported(hf: Any) -> list[str]:
    """What keeps ``hf`` from running on the Megatron-core trainer, each as a sentence ([] if
    nothing)."""
    model_type = _get(hf, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return [f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"]
    problems = []
    if _get(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {_get(hf, 'hidden_act')!r} (SwiGLU needs silu)")
    if rope(hf)[1] != "default":
        problems.append(f"rope type {rope(hf)[1]!r} (plain rotary embeddings only)")
    if model_type == "llama" and _get(hf, "attention_bias", False):
        problems.append("attention_bias (an o_proj bias has no Megatron counterpart here)")
    if _get(hf, "mlp_bias", False):
        problems.append("mlp_bias")
    if _get(hf, "use_sliding_window", False):
        problems.append("use_sliding_window (full attention only)")
    return problems


def transformer_config_kwargs(
    hf: Any,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    bf16: bool = False,
    recompute: bool = False,
) -> dict[str, Any]:
    """``megatron.core.transformer.TransformerConfig``'s arguments for ``hf``: its sizes, RMSNorm,
    SwiGLU, biases on q/k/v only (Qwen2), no dropout, no fused kernels that need Apex or
    Transformer Engine, bf16 parameters with ``bf16`` (the distributed optimizer keeps fp32
    main copies), whole-layer recomputation with ``recompute``. Weights are loaded after the
    model is built, so no initialisation runs."""
    import torch
    import torch.nn.functional as F

    shape = DecoderShape.from_hf(hf)
    dtype = torch.bfloat16 if bf16 else torch.float32
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(_get(hf, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        init_method_std=float(_get(hf, "initializer_range", 0.02)),
        perform_initialization=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=False,  # (sequences of any length; it would need a multiple of tp)
        variable_seq_lengths=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform")
        kwargs.update(recompute_num_layers=1)
    return kwargs


def gpt_model_kwargs(hf: Any, shape: DecoderShape) -> dict[str, Any]:
    """``GPTModel``'s arguments besides the config and the layer spec (the vocabulary padded as
    ``shape`` says; rotary embeddings over the whole head, HF's half-rotation layout)."""
    return dict(
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=int(_get(hf, "max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope(hf)[0],
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True,
    )
