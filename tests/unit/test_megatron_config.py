"""Megatron-core settings from Hugging Face configs (no megatron-core needed)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.assets.real_shapes import real_config
from tandem.trainer.megatron_config import (
    gpt_model_kwargs,
    rope,
    transformer_config_kwargs,
    unsupported,
)
from tandem.trainer.megatron_weights import DecoderShape


def test_qwen25_1p5b_shape() -> None:
    hf = real_config("1.5b")
    kwargs = transformer_config_kwargs(hf, tensor_parallel=2, pipeline_parallel=4, bf16=True)
    assert unsupported(hf) == []
    expected = dict(
        num_layers=28,
        hidden_size=1536,
        ffn_hidden_size=8960,
        num_attention_heads=12,
        num_query_groups=2,
        kv_channels=128,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=True,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=4,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    assert {k: kwargs[k] for k in expected} == expected
    assert kwargs["activation_func"] is F.silu
    shape = DecoderShape.from_hf(hf, tensor_parallel=2, divisible_by=128)
    model = gpt_model_kwargs(hf, shape)
    assert model["vocab_size"] == 152_064  # 151,936 = 593.5 * 256: up to 594 * 256
    assert model["rotary_base"] == 1_000_000.0
    assert model["share_embeddings_and_output_weights"] is True


def test_embedded_model_from_its_json() -> None:
    hf = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    kwargs = transformer_config_kwargs(hf, recompute=True)
    assert (kwargs["kv_channels"], kwargs["num_query_groups"], kwargs["params_dtype"]) == (
        32,
        2,
        torch.float32,
    )
    assert kwargs["recompute_granularity"] == "full"
    shape = DecoderShape.from_hf(hf, tensor_parallel=2, divisible_by=64)
    assert gpt_model_kwargs(hf, shape)["vocab_size"] == 384  # 257 up to a multiple of 128
    assert rope(hf) == (10000.0, "default")


def test_llama_without_biases_and_what_is_refused() -> None:
    llama = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4)
    assert unsupported(llama) == []
    assert transformer_config_kwargs(llama)["add_qkv_bias"] is False
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = LlamaConfig(rope_scaling=llama3, mlp_bias=True)
    problems = unsupported(scaled)
    assert any("llama3" in p for p in problems) and "mlp_bias" in problems
    assert "gemma" in unsupported({"model_type": "gemma"})[0]


def test_policy_backend_refuses_fsdp2_only_settings() -> None:
    from pydantic import ValidationError

    from tandem.config.lora import LoraConfig
    from tandem.config.models import PolicyConfig

    assert PolicyConfig().backend == "fsdp2"
    PolicyConfig(backend="fsdp2", packing=True, lora=LoraConfig())  # fsdp2 takes both
    with pytest.raises(ValidationError, match=r"does not take policy.lora .*policy.packing"):
        PolicyConfig(backend="megatron", packing=True, lora=LoraConfig())


def test_megatron_without_gpus_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem import machine
    from tandem.cluster.spec import RuntimeSpec
    from tandem.config.models import ClusterConfig, GenerationConfig, PolicyConfig, RefitConfig
    from tandem.machine import megatron_misfit

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(machine, "nvidia_devices", lambda: [])
    assert "set policy.backend=fsdp2" in (megatron_misfit(None) or "")
    assert megatron_misfit("10.0.0.1:6379") is None  # a cluster to join may have GPUs
    spec = RuntimeSpec(
        ClusterConfig(), PolicyConfig(backend="megatron"), GenerationConfig(), RefitConfig()
    )
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        spec.resolve()
    monkeypatch.setattr(machine, "nvidia_devices", lambda: ["/dev/nvidia0"])
    assert megatron_misfit(None) is None


def test_preflight_checks_the_model_and_the_split() -> None:
    from tandem.config.models import MegatronConfig, PolicyConfig
    from tandem.preflight import check_megatron_model

    hf = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    check_megatron_model(PolicyConfig(backend="megatron"), hf)
    split = PolicyConfig(backend="megatron", megatron=MegatronConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        check_megatron_model(split, hf)
    with pytest.raises(ValueError, match=r"cannot convert .*'gemma'.*policy\.backend=fsdp2"):
        check_megatron_model(PolicyConfig(backend="megatron"), hf | {"model_type": "gemma"})


def test_data_parallel_ranks_follow_megatrons_order() -> None:
    from tandem.config.megatron import data_parallel_ranks

    # 8 ranks, tp 2, pp 2: tp fastest, then dp, pp outermost (Megatron's "tp-cp-ep-dp-pp")
    assert data_parallel_ranks(8, 2, 2) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert data_parallel_ranks(4, 1, 1) == [0, 1, 2, 3]
    assert data_parallel_ranks(4, 4, 1) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="does not divide"):
        data_parallel_ranks(6, 4, 1)


def test_megatron_layout_that_does_not_divide_the_trainers(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem import machine
    from tandem.cluster.spec import RuntimeSpec
    from tandem.config.models import (
        ClusterConfig,
        GenerationConfig,
        MegatronConfig,
        PolicyConfig,
        RefitConfig,
    )

    monkeypatch.setattr(machine, "nvidia_devices", lambda: ["/dev/nvidia0"])
    policy = PolicyConfig(backend="megatron", megatron=MegatronConfig(tensor_parallel_size=2))
    spec = RuntimeSpec(ClusterConfig(num_trainers=3), policy, GenerationConfig(), RefitConfig())
    with pytest.raises(ValueError, match=r"cluster.num_trainers=3 does not divide"):
        spec.resolve()
