"""Host time and aten ops per micro-batch of ``PolicyTrainer.train``, against a plain forward and
backward of the same model stack, on a model whose arithmetic is negligible: a random Qwen2 with
a real layer count (28, as 1.5B) and a tiny width (hidden 64, 4 heads, 2 KV heads, intermediate
128), so what is timed is the host's work (Python, dispatch, kernel launches on a GPU).

Per setting (the GPU runs' settings: fp32; ``mixed_precision``, FSDP2 on one rank; activation
checkpointing; LoRA rank 32 on every projection with bf16 weights; their combinations; ``_compile``:
the decoder layers compiled, ``policy.compile``) one JSON line:

- ``train_ms_per_mb``, ``train_ops_per_mb``, ``train_calls_per_mb``: the marginal cost of a
  micro-batch in ``train`` (a GRPO batch of 64 rows, 8 prompts x 8 responses of 16-46 tokens
  after a 20-token prompt, minus a batch of its first 8 rows, divided by the extra
  micro-batches): host milliseconds, aten ops (``TorchDispatchMode``), Python function calls
  (cProfile); ``train_fixed_ms``: the rest of a step (planning, clipping, AdamW);
- ``peer_ms_per_mb``, ``peer_ops_per_mb``, ``peer_calls_per_mb``: the same micro-batches'
  ``lm(input_ids, labels=input_ids)`` forward (Hugging Face's own loss on full logits) and
  backward through a second copy of the model built the same way (peft, checkpointing, FSDP2
  with the model as root);
- ``bare_*``: that plain forward and backward on the bare fp32 (bf16 with LoRA) model, without
  peft, checkpointing or FSDP2: what transformers alone costs.

    PYTHONPATH=src:bench python bench/trainer_host_overhead.py [--vocab 1024 151936]
        [--layers 28] [--settings fp32 mp_ac lora_bf16_ac ...]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import platform
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from aten_calls import AtenCalls
from ceilings import emit

from tandem.algorithms.losses import ClippedPolicyLoss
from tandem.config.lora import LoraConfig
from tandem.config.models import PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.trainer import PolicyTrainer, lora
from tandem.trainer.parallelize import apply_activation_checkpointing, apply_fsdp, compile_layers

LORA = LoraConfig(rank=32, alpha=64)
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "ac": dict(activation_checkpointing=True),
    "mp": dict(mixed_precision=True),
    "mp_ac": dict(mixed_precision=True, activation_checkpointing=True),
    "lora_bf16": dict(dtype="bfloat16", lora=LORA),
    "lora_bf16_ac": dict(dtype="bfloat16", activation_checkpointing=True, lora=LORA),
    "lora_mp_ac": dict(mixed_precision=True, activation_checkpointing=True, lora=LORA),
    "mp_ac_compile": dict(mixed_precision=True, activation_checkpointing=True, compile=True),
    "lora_bf16_ac_compile": dict(
        dtype="bfloat16", activation_checkpointing=True, lora=LORA, compile=True
    ),
}


def write_model(root: Path, layers: int, vocab: int) -> Path:
    path = root / f"qwen2-tiny-{layers}l-{vocab}v"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab,
            tie_word_embeddings=True,
        )
        transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def grpo_batch(vocab: int, prompts: int = 8, group: int = 8, prompt: int = 20) -> TrainBatch:
    """``prompts`` x ``group`` rows: a shared prompt, then 16-46 response tokens."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 47, (prompts * group,), generator=gen)
    width = prompt + int(lengths.max())
    ids = torch.randint(0, vocab, (prompts * group, width), generator=gen)
    ids[:, :prompt] = ids[::group, :prompt].repeat_interleave(group, 0)
    t = torch.arange(width)[None]
    attention = (t < prompt + lengths[:, None]).long()
    loss_mask = (attention.bool() & (t >= prompt)).float()
    advantages = torch.randn(prompts * group, 1, generator=gen) * loss_mask
    generator = -torch.rand(prompts * group, width, generator=gen) * loss_mask
    return TrainBatch(ids * attention, attention, loss_mask, advantages, None, generator)


def peer_model(config: PolicyConfig, device: torch.device, plain: bool) -> Any:
    """The policy's Hugging Face model built as ``PolicyTrainer`` builds it (``plain``: bare)."""
    lm: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(config.model_path), dtype=torch.bfloat16 if config.dtype == "bfloat16" else None
    )
    lm.config.use_cache = False
    if plain:
        return lm.to(device)
    if config.lora is not None:
        lora.wrap_lora(lm, config.lora)
    if config.compile:
        compile_layers(lm)
    if config.activation_checkpointing:
        apply_activation_checkpointing(lm)
    if config.mixed_precision or config.cpu_offload:
        apply_fsdp(lm, lm, config, device)
    return lm.to(device)


def peer_pass(lm: Any, inputs: list[torch.Tensor]) -> None:
    for ids in inputs:
        lm(input_ids=ids, labels=ids).loss.backward()


def peer_measure(
    lm: Any, plan: list[torch.Tensor], args: argparse.Namespace, sync: Callable[[], None]
) -> dict[str, float]:
    return measure(lambda: peer_pass(lm, plan), args.repeats, sync)


def measure(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median host seconds of ``run`` (after a warm-up), its aten ops and Python calls."""
    run()
    times, cpu = [], []
    for _ in range(repeats):
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        sync()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    with AtenCalls(data_only=False) as ops:
        run()
    profiler = cProfile.Profile()
    profiler.runcall(run)
    calls = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
    return {
        "s": statistics.median(times),
        "cpu_s": statistics.median(cpu),
        "ops": ops.count,
        "calls": calls,
    }


def run_setting(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    config = PolicyConfig(model_path=path, micro_batch_size=8, **SETTINGS[name])
    trainer = PolicyTrainer(config)
    device = trainer.device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    loss = ClippedPolicyLoss()
    big = grpo_batch(args.vocab_size)
    small = big.select(slice(0, 8))
    plan = [mb.batch.input_ids.to(device) for mb, _ in trainer._micro_batches(big)]
    count = len(plan)
    assert len(trainer._micro_batches(small)) == 1
    full = measure(lambda: trainer.train(big, loss), args.repeats, sync)
    one = measure(lambda: trainer.train(small, loss), args.repeats, sync)
    peer_figures = peer_measure(peer_model(config, device, plain=False), plan, args, sync)
    bare_figures = peer_measure(peer_model(config, device, plain=True), plan, args, sync)
    gc.collect()

    def per_mb(total: dict[str, float], key: str, scale: float = 1.0) -> float:
        return round(total[key] * scale / count, 2)

    marginal = {k: (full[k] - one[k]) / (count - 1) for k in full}
    return {
        "figure": "trainer_host_overhead",
        "setting": name,
        "layers": args.layers,
        "vocab": args.vocab_size,
        "micro_batches": count,
        "tokens": int(big.attention_mask.sum()),
        "train_ms_per_mb": round(marginal["s"] * 1e3, 2),
        "train_cpu_ms_per_mb": round(marginal["cpu_s"] * 1e3, 2),
        "train_ops_per_mb": round(marginal["ops"]),
        "train_calls_per_mb": round(marginal["calls"]),
        "train_fixed_ms": round((one["s"] - marginal["s"]) * 1e3, 1),
        "peer_ms_per_mb": per_mb(peer_figures, "s", 1e3),
        "peer_cpu_ms_per_mb": per_mb(peer_figures, "cpu_s", 1e3),
        "peer_ops_per_mb": round(peer_figures["ops"] / count),
        "peer_calls_per_mb": round(peer_figures["calls"] / count),
        "bare_ms_per_mb": per_mb(bare_figures, "s", 1e3),
        "bare_cpu_ms_per_mb": per_mb(bare_figures, "cpu_s", 1e3),
        "bare_ops_per_mb": round(bare_figures["ops"] / count),
        "device": device.type,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    root = Path(tempfile.gettempdir()) / "tandem-host-overhead"
    for vocab in args.vocab:
        args.vocab_size = vocab
        path = write_model(root, args.layers, vocab)
        for name in args.settings:
            emit(run_setting(name, path, args))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
