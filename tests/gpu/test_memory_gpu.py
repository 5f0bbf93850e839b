"""Device memory of a colocated trainer across refit and offload (one GPU, two processes).

A PolicyTrainer trains a step, refits an HfGenerator in a second process on the same GPU
through the colocated CUDA IPC transport, then offloads. Checks: the generator got exactly the
trainer's weights; the trainer's peak during refit is its resident state + the two bucket
buffers + the stated slack; after offload the trainer holds 0 bytes allocated and reserved.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file

from tandem.algorithms.losses import nll_loss
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.tensors.devices import release_device_caches
from tandem.trainer import PolicyTrainer
from tandem.weight_sync import make_receiver, make_sender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("process_group"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 4096
BUCKET_BYTES = 2**20  # the 2 MiB embedding and LM head are split over buckets
SLACK_BYTES = 2**20
"""Beyond buckets and gathers: the allocator's 512-byte rounding and small scratch tensors."""
SETUPS = {"plain": {}, "fsdp": {"mixed_precision": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~6M-parameter bf16 Qwen2 with the embedded model's tokenizer (HfGenerator needs one)."""
    path = tmp_path_factory.mktemp("qwen2-refit")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        eos_token_id=256,
        pad_token_id=256,
    )
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (DEFAULT_MODEL_DIR / name).exists():
            shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


def _generator_main(model_dir: str, specs: Any, results: Any) -> None:
    """The colocated generator: HfGenerator on the same GPU, refitted from the trainer."""
    from tandem.generation.hf_generator import HfGenerator

    torch.cuda.set_device(0)
    generator = HfGenerator(model_dir, device="cuda:0", dtype="bfloat16")
    results.put("ready")
    while (spec := specs.get()) is not None:
        generator.load_weights(make_receiver(spec, "cuda:0").iter_weights())
        torch.cuda.synchronize()
        results.put({n: t.detach().cpu() for n, t in generator.model.state_dict().items()})
    generator.shutdown()


def live_blocks() -> list[Any]:
    """CUDA tensors still reachable from Python, with their referrers' types (diagnostics)."""
    return [
        (tuple(t.shape), str(t.dtype), sorted({type(r).__name__ for r in gc.get_referrers(t)}))
        for t in gc.get_objects()
        if isinstance(t, torch.Tensor) and not t.is_meta and t.device.type == "cuda"
    ][:8]


def make_batch(seed: int = 0, size: int = 4, width: int = 32) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, width), generator=gen)
    mask = torch.ones(size, width)
    mask[:, :4] = 0
    return TrainBatch(ids, torch.ones(size, width, dtype=torch.long), mask)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_refit_then_offload_leaves_the_trainer_nothing(model_dir: Path, setup: str) -> None:
    ctx = mp.get_context("spawn")
    specs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_generator_main, args=(str(model_dir), specs, results))
    proc.start()
    try:
        _check_refit_and_offload(model_dir, setup, specs, results)
    finally:
        specs.put(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def _check_refit_and_offload(model_dir: Path, setup: str, specs: Any, results: Any) -> None:
    dtype = "float32" if setup == "fsdp" else "bfloat16"  # fsdp: fp32 master, bf16 compute
    # What this process held before the trainer existed; cuBLAS workspaces of earlier tests (they
    # live in the caching allocator, and offload() releases them) returned first.
    gc.collect()
    release_device_caches()
    before_allocated, before_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    optimizer = OptimizerConfig(lr=1e-3, max_grad_norm=1.0)
    config = PolicyConfig(model_path=model_dir, dtype=dtype, optimizer=optimizer, **SETUPS[setup])
    trainer = PolicyTrainer(config, device="cuda:0")
    trainer.train(make_batch(), nll_loss)
    expected = {n: t.cpu().clone() for n, t in trainer.iter_weights(torch.bfloat16)}
    initial = load_file(model_dir / "model.safetensors")
    assert any(not torch.equal(initial[n], t) for n, t in expected.items())  # trained
    metadata = trainer.weight_metadata(torch.bfloat16)
    assert results.get(timeout=90) == "ready"
    # The GPU host has no Ray config plumbing: the two fields RefitConfig carries.
    refit = SimpleNamespace(transport="colocated", bucket_bytes=BUCKET_BYTES)
    sender = make_sender(refit, "cuda:0", timeout_s=60)  # type: ignore[arg-type]
    gc.collect()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # One rank, onloaded: iter_weights() yields the parameters themselves. plain sends them as
    # they are (bf16), read in place; fsdp casts its fp32 masters to bf16: new tensors, streamed.
    assert trainer.streams_live_weights
    live = setup == "plain"
    weights = [t for _, t in trainer.iter_weights(torch.bfloat16)] if live else []
    spec = sender.prepare(metadata, live_tensors=weights)
    specs.put(spec)
    stats = sender.send() if live else sender.send(trainer.iter_weights(torch.bfloat16))
    del weights
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    received = results.get(timeout=90)
    sender.close()

    assert stats.num_buckets == len(spec.plan.buckets) > 4
    assert (stats.in_place_bytes > 0) == live, stats
    assert set(expected) <= set(received)
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name
    # What the weight stream itself allocates: FSDP2 gathers one full fp32 tensor at a time and
    # casts it to bf16; the plain bf16 trainer streams its own parameters, no copy.
    largest = max(t.numel() for t in expected.values())
    gathers = largest * (4 + 2) if setup == "fsdp" else 0
    budget = 2 * BUCKET_BYTES + gathers + SLACK_BYTES
    assert peak - resident <= budget, (peak - resident, budget)
    assert torch.cuda.memory_allocated() == resident  # the buckets are gone after send()

    trainer.offload()
    assert torch.cuda.memory_allocated() == before_allocated, live_blocks()
    assert torch.cuda.memory_reserved() == before_reserved
    del trainer
    gc.collect()
