"""Extra device memory of the training loss over the model's own, at real vocabulary.

The LM head + log-softmax + policy-gradient loss of ``tokens`` hidden states against a
``vocab x hidden`` head, forward and backward, three ways: ``ChunkedTokenLogprobs`` (the
trainer's), the per-chunk ``torch.utils.checkpoint`` it replaced, and full logits. "Extra" is
the peak allocated during the loss's forward + backward minus what the model owns anyway (the
hidden states, the head, the head's gradient and the hidden states' gradient). One JSON line
per way; CUDA when there is one (``max_memory_allocated``), else only the times on the CPU.

    PYTHONPATH=src:bench python bench/chunked_loss_memory.py [--tokens 16384] [--hidden 1536]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from ceilings import emit
from torch.utils.checkpoint import checkpoint

from tandem.trainer.logprobs import token_logprobs

Way = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def fused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    return token_logprobs(hidden, weight, targets, chunk)[0]


def _chunk(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(F.linear(h, w).float(), dim=-1)
    return logp.gather(-1, t[:, None])[:, 0]


def checkpointed(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    parts = [
        checkpoint(
            _chunk, hidden[s : s + chunk], weight, targets[s : s + chunk], use_reentrant=False
        )
        for s in range(0, len(targets), chunk)
    ]
    return torch.cat(parts)


def full(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    return _chunk(hidden, weight, targets)


def measure(way: Way, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (
        torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    ).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device)
    advantages = torch.randn(args.tokens, device=device)
    # allocated during the loss and owned by the model anyway: the two gradients
    gradients = (hidden.numel() + weight.numel()) * hidden.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = -(advantages * way(hidden, weight, targets, args.chunk)).mean()
    loss.backward()
    record = {"extra_bytes": float("nan")}
    if device.type == "cuda":
        torch.cuda.synchronize()
        record["extra_bytes"] = torch.cuda.max_memory_allocated() - base - gradients
    record["seconds"] = time.perf_counter() - start
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--ways", nargs="+", default=["fused", "checkpointed", "full"])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ways = {"fused": fused, "checkpointed": checkpointed, "full": full}
    for name in args.ways:
        try:
            measure(ways[name], args, device)  # warm-up (kernels, allocator)
            record = measure(ways[name], args, device)
        except torch.OutOfMemoryError:
            record = {"seconds": float("nan"), "extra_bytes": float("inf")}
        emit(
            {
                "figure": "loss_extra_memory",
                "way": name,
                "tokens": args.tokens,
                "hidden": args.hidden,
                "vocab": args.vocab,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "extra_gib": round(record["extra_bytes"] / 2**30, 3),
                "seconds": round(record["seconds"], 4),
            }
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
