"""Refit throughput: colocated vs split, per bucket size, against a memcpy ceiling.

The sender (this process) streams a random Qwen2-shaped state dict; one receiver in a spawned
process copies every tensor into its own parameters (as vLLM's ``reload_weights`` does). Prints
one JSON line per figure. The ceiling is a single-process ``dst.copy_(src)`` of the same
tensors, with as many threads as each refit process gets (half the cores: sender and receiver
run at once). Colocated copies every byte twice (pack, then the receiver's copy), so its ideal
is about half the ceiling.

    .venv/bin/python bench/refit.py [--layers 24] [--dtype bfloat16] [--buckets-mib 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from tandem.config.models import RefitConfig
from tandem.weight_sync import TensorMeta, make_receiver, make_sender


def qwen2_metadata(
    num_layers: int, dtype: torch.dtype, hidden: int = 896, intermediate: int = 4864
) -> list[TensorMeta]:
    """Parameter names and shapes of Qwen2.5-0.5B (14 heads, 2 KV heads, head_dim 64)."""
    vocab, kv = 151936, 128
    metas = [TensorMeta("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for name, shape in [
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.q_proj.bias", (hidden,)),
            ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.k_proj.bias", (kv,)),
            ("self_attn.v_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.bias", (kv,)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (intermediate, hidden)),
            ("mlp.up_proj.weight", (intermediate, hidden)),
            ("mlp.down_proj.weight", (hidden, intermediate)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        ]:
            metas.append(TensorMeta(p + name, shape, dtype))
    metas.append(TensorMeta("model.norm.weight", (hidden,), dtype))
    return metas


def _threads_per_process() -> int:
    # Sender and receiver share the host: oversubscribed OpenMP threads spin against each other.
    return max(1, (os.cpu_count() or 2) // 2)


def _receiver(metas: list[TensorMeta], specs: Any, done: Any) -> None:
    torch.set_num_threads(_threads_per_process())
    params = {m.name: torch.empty(m.shape, dtype=m.dtype) for m in metas}
    for p in params.values():
        p.zero_()  # fault the pages in, as a loaded model has them
    done.put("ready")
    while (spec := specs.get()) is not None:
        for name, tensor in make_receiver(spec, "cpu", 1).iter_weights():
            params[name].copy_(tensor)
        done.put(float(params[metas[-1].name].float().sum()))


def memcpy_ceiling(state: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Best of 3 single-process copies of every tensor into a preallocated twin."""
    dsts = {n: torch.empty_like(t).zero_() for n, t in state.items()}
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for name, tensor in state.items():
            dsts[name].copy_(tensor)
        best = min(best, time.perf_counter() - start)
    return best, num_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--buckets-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--transports", nargs="+", default=["colocated", "split"])
    args = parser.parse_args()
    torch.set_num_threads(_threads_per_process())
    metas = qwen2_metadata(args.layers, getattr(torch, args.dtype))
    state = {m.name: torch.empty(m.shape, dtype=m.dtype).uniform_(-1, 1) for m in metas}
    num_params = sum(t.numel() for t in state.values())
    seconds, num_bytes = memcpy_ceiling(state)
    ceiling = num_bytes / seconds / 1e9
    common = {"params": num_params, "dtype": args.dtype, "bytes": num_bytes}
    print(
        json.dumps({"figure": "memcpy_ceiling", **common, "seconds": seconds, "gb_per_s": ceiling})
    )
    ctx = mp.get_context("spawn")
    for transport in args.transports:
        for mib in args.buckets_mib:
            specs, done = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=_receiver, args=(metas, specs, done))
            proc.start()
            assert done.get(timeout=120) == "ready"
            config = RefitConfig(transport=transport, bucket_bytes=mib * 2**20)  # type: ignore[arg-type]
            sender = make_sender(config, "cpu", timeout_s=120)
            runs = []
            for _ in range(2):  # the first refit also forms the group / faults fresh buffers
                specs.put(sender.prepare(metas))
                runs.append(sender.send(iter(state.items())))
                checksum = done.get(timeout=120)
            expected = float(state[metas[-1].name].float().sum())
            assert checksum == expected, "receiver got different weights"
            specs.put(None)
            proc.join(timeout=60)
            sender.close()
            warm = runs[-1]
            record = {"figure": "refit", "transport": transport, "bucket_mib": mib, **common}
            record |= {"seconds": warm.seconds, "gb_per_s": warm.gb_per_s}
            record |= {"first_refit_seconds": runs[0].seconds, "num_buckets": warm.num_buckets}
            record["fraction_of_memcpy"] = warm.gb_per_s / ceiling
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
