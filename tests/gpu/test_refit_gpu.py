"""CUDA refit between processes: colocated through CUDA IPC on one GPU, split over NCCL on two."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tandem.tensors import device_copies
from tandem.weight_sync import RefitError, make_receiver, make_sender, metadata_of
from tandem.weight_sync.buckets import flat_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BUCKET_BYTES = 2**20


def gpu_state_dict(seed: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "embed.weight": torch.randn(1024, 384, generator=gen).to(torch.bfloat16),  # 768 KiB: whole
        "big.weight": torch.randn(600, 1000, generator=gen),  # 2.4 MB: split over 3 buckets
        "step": torch.tensor(seed, dtype=torch.int64),
        # not contiguous: even in a live refit it is packed, so the buckets are used too
        "proj.weight": torch.randn(96, 160, generator=gen).t(),
    }
    for i in range(6):
        tensors[f"layers.{i}.w"] = torch.randn(256, 512, generator=gen).to(torch.bfloat16)
        tensors[f"layers.{i}.w_fp8"] = torch.randint(
            0, 256, (128, 128), generator=gen, dtype=torch.uint8
        ).view(torch.float8_e4m3fn)
        tensors[f"layers.{i}.scale"] = torch.rand((), generator=gen)
    return {name: t.to(device) for name, t in tensors.items()}  # .to keeps the strides


def _load(weights: Any, params: dict[str, torch.Tensor], device: str) -> None:
    """What a consumer does (vLLM reload_weights): copy each view, keep no reference after."""
    for name, tensor in weights:
        assert tensor.device == torch.device(device)
        params[name].copy_(tensor)
    torch.cuda.synchronize()


def _receiver_main(rank: int, device: str, specs: Any, results: Any) -> None:
    torch.cuda.set_device(device)
    results.put("ready")
    while (spec := specs.get()) is not None:
        expected = gpu_state_dict(spec.refit_id, device)
        params = {n: torch.zeros_like(t) for n, t in expected.items()}
        receiver = make_receiver(spec, device, rank)
        if spec.refit_id == 1:
            _load(receiver.iter_weights(), params, device)
        else:  # as HfGenerator.receive_weights
            receiver.copy_into([params[meta.name] for meta in spec.plan.tensors])
            torch.cuda.synchronize()
        bad = [
            n for n, t in expected.items() if not torch.equal(flat_bytes(params[n]), flat_bytes(t))
        ]
        results.put((spec.refit_id, len(params), bad))


@contextlib.contextmanager
def _receiver(target: Any, *args: Any) -> Iterator[tuple[Any, Any]]:
    """A spawned ``target(*args, specs, results)`` that puts "ready" first and ends on None;
    yields the two queues."""
    ctx = mp.get_context("spawn")
    specs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, specs, results))
    proc.start()
    try:
        assert results.get(timeout=120) == "ready"
        yield specs, results
    finally:
        specs.put(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def _run(transport: str, sender_device: str, receiver_device: str, live: bool = False) -> None:
    with _receiver(_receiver_main, 1, receiver_device) as (specs, results):
        # The GPU host has no pydantic: the two fields RefitConfig would carry.
        config = SimpleNamespace(transport=transport, bucket_bytes=BUCKET_BYTES)
        sender = make_sender(config, sender_device, timeout_s=60)  # type: ignore[arg-type]
        for refit_id in (1, 2):
            state = gpu_state_dict(refit_id, sender_device)
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated(sender_device)
            # live: the tensors themselves, named at prepare(); a strided one is still packed
            spec = sender.prepare(
                metadata_of(state.items()), live_tensors=state.values() if live else ()
            )
            specs.put(spec)
            stats = sender.send() if live else sender.send(iter(state.items()))
            assert stats.num_buckets == len(spec.plan.buckets) > 3
            # live: the receiver copied (most) tensors straight out of this process's memory
            assert (stats.in_place_bytes > 0) == live, stats
            assert results.get(timeout=120) == (refit_id, len(state), [])
            torch.cuda.synchronize()
            # The refit buckets are gone: the trainer holds exactly what it held before.
            assert torch.cuda.memory_allocated(sender_device) == baseline
        sender.close()


def test_colocated_cuda_ipc_two_processes_one_gpu() -> None:
    _run("colocated", "cuda:0", "cuda:0")


def test_colocated_live_tensors_are_read_in_place() -> None:
    _run("colocated", "cuda:0", "cuda:0", live=True)


def laid_out_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors laid out as a trainer's parameters after ``onload()``: back to back in one
    allocation (every size a multiple of the 256-byte alignment: no gaps), one split over three
    buckets."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.randn(1024, 384, generator=gen).to(torch.bfloat16)}
    tensors["big.weight"] = torch.randn(600, 1024, generator=gen)  # 2.4 MB: 3 buckets
    for i in range(6):
        tensors[f"layers.{i}.w"] = torch.randn(256, 512, generator=gen).to(torch.bfloat16)
        tensors[f"layers.{i}.norm"] = torch.randn(512, generator=gen).to(torch.bfloat16)
    cuda = torch.device("cuda", 0)
    return dict(zip(tensors, device_copies(list(tensors.values()), cuda), strict=True))


def _laid_out_receiver(specs: Any, results: Any) -> None:
    torch.cuda.set_device(0)
    results.put("ready")
    while (spec := specs.get()) is not None:
        expected = laid_out_state(spec.refit_id)
        zeros = [torch.zeros(m.shape, dtype=m.dtype) for m in spec.plan.tensors]
        targets = device_copies(zeros, torch.device("cuda", 0))  # as HfGenerator's parameters
        try:
            copies = make_receiver(spec, "cuda:0").copy_into(targets)
        except RefitError as error:
            results.put(("error", str(error)))
            continue
        torch.cuda.synchronize()
        bad = [
            m.name
            for m, t in zip(spec.plan.tensors, targets, strict=True)
            if not torch.equal(flat_bytes(t), flat_bytes(expected[m.name]))
        ]
        results.put((copies, bad))


def test_live_refit_between_laid_out_models_is_one_copy_per_bucket() -> None:
    """Trainer and generator both lay their parameters out back to back: the trainer announces
    each bucket as one run of its memory and the generator copies it with one launch, without a
    tensor per parameter. A split tensor is copied once, in the bucket of its last piece.
    (``_run(live=True)`` covers a live refit that also packs: a strided tensor.)"""
    with _receiver(_laid_out_receiver) as (specs, results):
        config = SimpleNamespace(transport="colocated", bucket_bytes=BUCKET_BYTES)
        sender = make_sender(config, "cuda:0", timeout_s=60)  # type: ignore[arg-type]
        for refit_id in (1, 2):
            state = laid_out_state(refit_id)
            torch.cuda.synchronize()
            # named at prepare(): the receiver maps the trainer's memory as it attaches
            spec = sender.prepare(metadata_of(state.items()), live_tensors=state.values())
            assert len(spec.segments) == 1 and spec.slots is None  # one allocation, no slots
            specs.put(spec)
            stats = sender.send()
            assert stats.in_place_bytes == stats.num_bytes
            completing = [b for b in spec.plan.buckets if any(p.is_last for p in b.pieces)]
            assert len(spec.plan.buckets) > len(completing) > 3
            assert results.get(timeout=120) == (len(completing), [])
        sender.close()


def test_live_refit_fails_on_both_sides_when_a_tensor_moved_after_prepare() -> None:
    """prepare() plans where the receivers read each live tensor; send() first checks that
    they are still there, then announces every bucket at once. A tensor that moved (an onload
    between the two) fails the sender before it announces anything, and the receiver through
    the abort (no silently wrong weights), fast. The next refit lands."""
    with _receiver(_laid_out_receiver) as (specs, results):
        config = SimpleNamespace(transport="colocated", bucket_bytes=BUCKET_BYTES)
        sender = make_sender(config, "cuda:0", timeout_s=60)  # type: ignore[arg-type]
        state = laid_out_state(1)
        spec = sender.prepare(metadata_of(state.items()), live_tensors=state.values())
        moved = state["layers.3.w"]
        torch.utils.swap_tensors(moved, moved.clone())  # the same tensor, in new memory
        torch.cuda.synchronize()
        specs.put(spec)
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"not where prepare\(\) found them"):
            sender.send()
        kind, message = results.get(timeout=60)
        assert kind == "error" and "not where prepare() found them" in message, message
        assert time.monotonic() - start < 30  # signalled, not timed out (60 s)
        state = laid_out_state(2)
        torch.cuda.synchronize()
        specs.put(sender.prepare(metadata_of(state.items()), live_tensors=state.values()))
        stats = sender.send()
        assert stats.in_place_bytes == stats.num_bytes
        copies, bad = results.get(timeout=60)
        assert copies > 3 and bad == []
        sender.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL split needs two GPUs")
def test_split_nccl_two_gpus() -> None:
    _run("split", "cuda:0", "cuda:1")


def test_colocated_names_expandable_segments_when_it_cannot_share_its_buckets() -> None:
    """Memory from expandable segments cannot go through CUDA IPC handles: prepare() says which
    setting to unset (when it allocates the buckets, before any receiver is needed) instead of
    failing inside the driver. The live tensor in such memory is packed, which needs the
    buckets. (The setting is read once per process, hence the subprocess.)"""
    code = (
        "import torch; from types import SimpleNamespace\n"
        "from tandem.weight_sync import make_sender\n"
        "config = SimpleNamespace(transport='colocated', bucket_bytes=2**20)\n"
        "sender = make_sender(config, 'cuda:0', timeout_s=10)\n"
        "w = torch.ones(512, 512, device='cuda')\n"
        "sender.prepare([('w', (512, 512), torch.float32)], live_tensors=[w])\n"
        "sender.send()\n"
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "CudaIpcError" in done.stderr and "expandable_segments:True" in done.stderr, done.stderr
