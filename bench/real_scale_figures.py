"""Figures of a GRPO step at real scale, from the step's metrics and the ceilings of the same run.

Train-phase MFU: model FLOPs of the train phase / (train seconds x bf16 matmul rate measured in
the same run). Model FLOPs per token of a sequence of T tokens (forward + backward, causal
attention, no recomputation counted)::

    6 * N_matmul + 6 * num_layers * hidden_size * T

with N_matmul the parameters that multiply (every layer's projections and MLP, the LM head;
not the embedding lookup nor the norms).

Decode roofline: a decode step of B rows reads every weight once and each row's KV cache, so
at HBM bandwidth BW (the device-to-device copy rate, read + write counted) the most tokens/s
are::

    B * BW / (W + B * kv_bytes_per_token * (prompt_len + response_len / 2))

W = the generator's weight bytes (N_matmul + norms, in its dtype); kv_bytes_per_token =
2 * num_layers * num_key_value_heads * head_dim * dtype bytes; lengths are the batch's means
(the context a row reads, averaged over its decode). The roofline fraction is generated
tokens/s (B * mean response length / generate seconds) over that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_sizes(path: Path) -> dict[str, int]:
    """Parameter counts and cache sizes of the Qwen2 model folder ``path``."""
    config = json.loads((path / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = kv_heads * head_dim
    per_layer = hidden * hidden * 2 + hidden * kv * 2 + hidden + 2 * kv  # q, o, k, v (+ biases)
    per_layer += 3 * hidden * config["intermediate_size"]
    head = config["vocab_size"] * hidden
    return {
        "matmul_params": layers * per_layer + head,
        "norm_params": (2 * layers + 1) * hidden,
        "layers": layers,
        "hidden": hidden,
        "kv_per_token": 2 * layers * kv,
    }


def decode_roofline(
    sizes: dict[str, int],
    rows: int,
    prompt: float,
    response: float,
    bandwidth_gb_s: float,
    dtype_bytes: int,
) -> float:
    """The most tokens/s a decode of ``rows`` rows can generate at ``bandwidth_gb_s`` (the
    module docstring's formula; ``prompt``/``response``: mean lengths; ``sizes``:
    ``model_sizes``)."""
    weight_bytes = dtype_bytes * (sizes["matmul_params"] + sizes["norm_params"])
    context = prompt + response / 2
    step_bytes = weight_bytes + rows * sizes["kv_per_token"] * dtype_bytes * context
    return rows * bandwidth_gb_s * 1e9 / step_bytes


def scale_figures(path: Path, record: dict[str, Any], args: Any) -> dict[str, float]:
    """MFU of the train phase and the decode roofline fraction of one step's ``record`` (or
    of the steps' medians), with ``args.ceilings`` of the same run."""
    sizes = model_sizes(path)
    tokens = record["throughput/tokens_per_s"] * record["timing/step_s"]
    rows = args.prompts * args.generations
    sequence = tokens / rows
    response = record["train/response_len_mean"]
    flops = tokens * (6 * sizes["matmul_params"] + 6 * sizes["layers"] * sizes["hidden"] * sequence)
    peak = args.ceilings["bf16_matmul_tflop_s"] * 1e12
    dtype_bytes = 2 if args.mixed_precision else 4
    bandwidth = args.ceilings["d2d_copy_gb_s"]
    roofline = decode_roofline(sizes, rows, sequence - response, response, bandwidth, dtype_bytes)
    generated = rows * response / record["timing/generate_s"]
    return {
        "train_tflop": round(flops / 1e12, 2),
        "train_mfu": round(flops / record["timing/train_s"] / peak, 3),
        "gen_tokens_per_s": round(generated, 1),
        "decode_roofline_tokens_per_s": round(roofline, 1),
        "decode_roofline_fraction": round(generated / roofline, 3),
    }
