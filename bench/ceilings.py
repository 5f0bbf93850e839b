"""Hardware ceilings measured in the same run as the figures they judge.

Prints one JSON line per ceiling: pinned host->device and device->host GB/s, device->device copy
GB/s (read + write counted), bf16 matmul TFLOP/s. Importable (``measure_ceilings``) so every GPU
benchmark measures its own ceiling in-process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

QWEN_1P5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
"""Qwen2.5-1.5B's shape."""
QWEN_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=151936,
    tie_word_embeddings=False,
)
"""An 8B shape (Qwen3-8B's sizes on the Qwen2 architecture)."""


def qwen2_config(shape: dict[str, Any]) -> Any:
    import transformers

    return transformers.Qwen2Config(max_position_embeddings=32768, **shape)


def random_model_dir(shape: dict[str, Any], root: str | None = None) -> Path:
    """A Hugging Face folder of a random bf16 Qwen2 of ``shape`` (made on the GPU, saved once)."""
    import transformers

    name = "qwen2-" + "-".join(str(shape[k]) for k in ("hidden_size", "num_hidden_layers"))
    path = Path(root or os.environ.get("TANDEM_BENCH_DIR", "/tmp/tandem-bench")) / name
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(qwen2_config(shape)).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def emit(record: dict[str, Any], sink: str | None = None) -> None:
    """Print one JSON line and append it to ``sink`` (or $BENCH_JSONL when set)."""
    line = json.dumps(record)
    print(line, flush=True)
    sink = sink or os.environ.get("BENCH_JSONL")
    if sink:
        with open(sink, "a") as handle:
            handle.write(line + "\n")


def _time_cuda(fn, repeats: int = 10) -> float:
    """Median seconds of ``fn`` on the current CUDA stream (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _copy_seconds(num_bytes: int) -> tuple[float, float, float]:
    device = torch.device("cuda")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)
    h2d = _time_cuda(lambda: dev.copy_(host, non_blocking=True))
    d2h = _time_cuda(lambda: host.copy_(dev, non_blocking=True))
    d2d = _time_cuda(lambda: dev2.copy_(dev))
    return h2d, d2h, d2d


def _matmul_seconds(n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return _time_cuda(lambda: a @ b, repeats=20)


def measure_ceilings(num_bytes: int = 4 * 2**30) -> dict[str, float]:
    """Pinned H2D/D2H GB/s, device copy GB/s (read + write counted) and bf16 matmul TFLOP/s."""
    h2d, d2h, d2d = _copy_seconds(num_bytes)
    n = 8192
    mm = _matmul_seconds(n)
    torch.cuda.empty_cache()
    return {
        "pinned_h2d_gb_s": num_bytes / h2d / 1e9,
        "pinned_d2h_gb_s": num_bytes / d2h / 1e9,
        "d2d_copy_gb_s": 2 * num_bytes / d2d / 1e9,
        "bf16_matmul_tflop_s": 2 * n**3 / mm / 1e12,
    }


if __name__ == "__main__":
    for key, value in measure_ceilings().items():
        emit({"figure": key, "value": round(value, 2)})
