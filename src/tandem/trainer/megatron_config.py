"""Megatron-core's model settings from a Hugging Face Qwen2/Llama config: the keyword arguments
of ``TransformerConfig`` and of ``GPTModel`` (pure functions, no megatron import); what keeps a
model from converting is ``config.megatron.unsupported``. ``hf`` is a transformers config or
its config.json as a dict."""

from __future__ import annotations

from typing import Any

from tandem.config.megatron import hf_value, qkv_bias, rope, unsupported
from tandem.trainer.megatron_weights import DecoderShape

__all__ = ["gpt_model_kwargs", "qkv_bias", "rope", "transformer_config_kwargs", "unsupported"]


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
        layernorm_epsilon=float(hf_value(hf, "rms_norm_eps", 1e-6)),
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
        init_method_std=float(hf_value(hf, "initializer_range", 0.02)),
        perform_initialization=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=False,  # (sequences of any length; it would need a multiple of tp)
        # micro-batches are trimmed to their longest sequence: stages exchange shapes (the MoE
        # dispatcher setting only satisfies the check that goes with it; there are no experts)
        variable_seq_lengths=pipeline_parallel > 1,
        moe_token_dispatcher_type="alltoall",
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
        max_sequence_length=int(hf_value(hf, "max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope(hf)[0],
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True,
    )
