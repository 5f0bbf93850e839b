"""Offload/onload of a PolicyTrainer on a GPU: nothing left on the device, every tensor object
kept, and training after onload continues exactly like a trainer that was never offloaded.

Parameterised over plain (one rank, no FSDP), FSDP2 on one rank (``mixed_precision`` forces
it) and FSDP2 with CPUOffloadPolicy, each with fp32 and bf16 parameters.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tandem.algorithms.losses import nll_loss
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.tensors.devices import release_device_caches
from tandem.trainer import PolicyTrainer
from tandem.trainer.offload import offload_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("process_group"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 300
SETUPS = {
    "plain": {},
    "fsdp": {"mixed_precision": True},
    "fsdp_cpu_offload": {"cpu_offload": True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_batch(seed: int, size: int = 4, width: int = 24) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, width), generator=gen)
    lengths = torch.randint(width // 2, width + 1, (size,), generator=gen)
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    loss_mask = attention.float()
    loss_mask[:, :4] = 0
    return TrainBatch(ids * attention, attention, loss_mask)


def make_trainer(model_dir: Path, setup: str, dtype: str) -> PolicyTrainer:
    optimizer = OptimizerConfig(lr=1e-3, eps=1e-6, max_grad_norm=1.0)
    config = PolicyConfig(model_path=model_dir, dtype=dtype, optimizer=optimizer, **SETUPS[setup])
    return PolicyTrainer(config, device="cuda:0")


def local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def state_tensors(trainer: PolicyTrainer) -> list[torch.Tensor]:
    assert trainer.optimizer is not None
    return [
        value
        for state in trainer.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def live_blocks() -> list[Any]:
    """What still holds device memory (for failure messages): CUDA tensors reachable from
    Python with the types of their referrers, then the allocator's block sizes."""
    found: list[Any] = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta and obj.device.type == "cuda":
            referrers = {type(r).__name__ for r in gc.get_referrers(obj)}
            found.append((tuple(obj.shape), str(obj.dtype), type(obj).__name__, sorted(referrers)))
            if len(found) > 6:
                break
    sizes = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    ]
    return [found, sizes[:12], len(sizes)]


def free_device() -> None:
    gc.collect()  # FSDP2 states hold reference cycles
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def baseline() -> tuple[int, int]:
    """Bytes allocated and reserved before the trainer is built, the device freed first: what
    its offload must return to. 0 and 0 alone; after the Megatron module 512 B that
    megatron-core keeps for the process (``bench/megatron_parity.py`` reports it too)."""
    free_device()
    release_device_caches()
    allocated = torch.cuda.memory_allocated()
    assert allocated <= 512, f"an earlier test leaked {live_blocks()}"
    return allocated, torch.cuda.memory_reserved()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_offload_frees_the_device_and_keeps_identity(
    model_dir: Path, setup: str, dtype: str
) -> None:
    before, before_reserved = baseline()
    first, second = make_batch(1), make_batch(2)
    trainer = make_trainer(model_dir, setup, dtype)
    loss_1 = trainer.train(first, nll_loss)["loss"]
    # the sharded parameters (a gathered FSDP2 module registers its unsharded ones instead)
    params = list(trainer.model.parameters())
    assert trainer.optimizer is not None
    optimized = trainer.optimizer.param_groups[0]["params"]
    assert all(a is b for a, b in zip(params, optimized, strict=True))
    trainer.logprobs(first)  # a no-grad forward leaves FSDP2's root and last layer gathered
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    states = state_tensors(trainer)
    state_locals = [local(s) for s in states]
    rotary = trainer.lm.model.rotary_emb
    inv_freq = rotary.inv_freq
    weights = {name: t.detach().cpu().clone() for name, t in trainer.iter_weights()}
    if dtype == "bfloat16":  # the host pool a run pins at start (float32: a pinned block each)
        trainer.pin_offload_memory()

    trainer.offload()
    assert torch.cuda.memory_allocated() == before, live_blocks()
    assert torch.cuda.memory_reserved() <= before_reserved
    pool = trainer._host_pool
    if pool is not None:  # pinned at the size asked, not rounded up to a power of two
        assert pool._buffer is not None and pool._buffer.is_pinned()
        assert pool._buffer.numel() == offload_bytes(trainer.model, trainer.optimizer, False)
    # (a DTensor parameter gets a new local tensor; the DTensor object itself is kept)
    locals_ = [local(p) for p in params]
    assert all(t.device.type == "cpu" for t in locals_ + state_locals + [inv_freq])
    if setup != "fsdp_cpu_offload":  # moved by offload: pinned, so onload runs at bus speed
        assert all(t.is_pinned() for t in locals_ + [s for s in state_locals if s.dim() > 0])
    del locals_

    trainer.onload()
    torch.cuda.synchronize()
    assert all(a is b for a, b in zip(params, trainer.model.parameters(), strict=True))
    optimized = trainer.optimizer.param_groups[0]["params"]
    assert all(a is b for a, b in zip(params, optimized, strict=True))
    assert all(a is b for a, b in zip(states, state_tensors(trainer), strict=True))
    assert all(a is local(b) for a, b in zip(state_locals, states, strict=True))
    assert rotary.inv_freq is inv_freq and inv_freq.device.type == "cuda"
    if setup != "fsdp_cpu_offload":
        assert all(local(p).device.type == "cuda" for p in params)
        # every parameter here is under 1 MiB: onload carves them from one allocation, so a
        # live refit maps one segment, not one small-pool segment per two of them
        assert len({local(p).untyped_storage().data_ptr() for p in params}) == 1
        # the gathered copies were resharded, not leaked: less than before, never more
        assert torch.cuda.memory_allocated() <= resident
    for name, tensor in trainer.iter_weights():
        assert torch.equal(tensor.cpu(), weights[name]), name
    loss_2 = trainer.train(second, nll_loss)["loss"]
    after = {name: t.detach().cpu().clone() for name, t in trainer.iter_weights()}
    del trainer, params, optimized, states, state_locals, rotary, inv_freq
    free_device()

    straight = make_trainer(model_dir, setup, dtype)
    expected_1 = straight.train(first, nll_loss)["loss"]
    expected_2 = straight.train(second, nll_loss)["loss"]
    tolerance = 1e-5 if dtype == "float32" else 1e-3
    assert loss_1 == pytest.approx(expected_1, rel=tolerance)
    assert loss_2 == pytest.approx(expected_2, rel=tolerance)
    assert loss_2 != pytest.approx(loss_1, rel=1e-4)  # the step did change the weights
    for name, tensor in straight.iter_weights():
        torch.testing.assert_close(after[name], tensor.cpu(), msg=name)
    del straight
    free_device()


@pytest.mark.parametrize("offload_base", [True, False])
@pytest.mark.parametrize("setup", ["plain", "fsdp"])
def test_lora_offload_moves_the_base_or_keeps_it(
    model_dir: Path, setup: str, offload_base: bool
) -> None:
    """``policy.lora.offload_base``: true leaves 0 B on the device; false leaves the frozen
    base's bytes (and buffers) there and moves the adapters, gradients and optimizer state."""
    from tandem.config.lora import LoraConfig

    before, _ = baseline()
    optimizer = OptimizerConfig(lr=1e-3, eps=1e-6)
    lora = LoraConfig(rank=8, alpha=16, offload_base=offload_base)
    config = PolicyConfig(model_path=model_dir, optimizer=optimizer, lora=lora, **SETUPS[setup])
    trainer = PolicyTrainer(config, device="cuda:0")
    first = make_batch(1)
    loss_1 = trainer.train(first, nll_loss)["loss"]
    params = dict(trainer.model.named_parameters())
    frozen = [local(p) for n, p in params.items() if not p.requires_grad]
    adapters = [local(p) for n, p in params.items() if p.requires_grad]
    frozen_bytes = sum(t.numel() * t.element_size() for t in frozen)
    frozen_bytes += sum(local(b).numel() * local(b).element_size() for b in trainer.model.buffers())

    trainer.offload()
    torch.cuda.synchronize()
    assert all(local(p).device.type == "cpu" for p in params.values() if p.requires_grad)
    assert all(local(s).device.type == "cpu" for s in state_tensors(trainer))
    if offload_base:
        assert torch.cuda.memory_allocated() == before, live_blocks()
    else:
        # FSDP2 pads each shard (one rank: none); nothing beyond the frozen base stays
        assert torch.cuda.memory_allocated() - before <= frozen_bytes + 512 * len(frozen)
        assert torch.cuda.memory_allocated() - before >= frozen_bytes * 0.99
        assert all(local(p).device.type == "cuda" for n, p in params.items() if not p.requires_grad)
    trainer.onload()
    assert all(local(p).device.type == "cuda" for p in params.values())
    if setup == "plain":  # the adapters come back back to back: an adapter refit copies them once
        assert trainer.adapters is not None
        assert trainer.adapters.scaled_copy(trainer.device) is not None
    loss_2 = trainer.train(make_batch(2), nll_loss)["loss"]
    assert loss_2 != pytest.approx(loss_1, rel=1e-4)
    del trainer, params, frozen, adapters
    free_device()


@pytest.mark.parametrize("setup", ["plain", "fsdp"])
def test_an_offload_of_the_optimizer_state_alone_keeps_the_weights(
    model_dir: Path, setup: str
) -> None:
    """``policy.offload_weights=false``: the offload moves AdamW's state (into a pool of its
    size) and leaves the weights and buffers, no more, on the device; after the onload the
    trainer trains as one never offloaded."""
    before, _ = baseline()
    optimizer = OptimizerConfig(lr=1e-3, eps=1e-6)
    config = PolicyConfig(model_path=model_dir, optimizer=optimizer, **SETUPS[setup])
    trainer = PolicyTrainer(config.model_copy(update={"offload_weights": False}), device="cuda:0")
    first, second = make_batch(1), make_batch(2)
    loss_1 = trainer.train(first, nll_loss)["loss"]
    weights = [local(p) for p in trainer.model.parameters()]
    weight_bytes = sum(t.numel() * t.element_size() for t in weights)
    weight_bytes += sum(local(b).numel() * local(b).element_size() for b in trainer.model.buffers())
    trainer.pin_offload_memory()

    trainer.offload()
    torch.cuda.synchronize()
    assert all(local(s).device.type == "cpu" for s in state_tensors(trainer))
    assert all(local(p).device.type == "cuda" for p in trainer.model.parameters())
    kept = torch.cuda.memory_allocated() - before
    assert weight_bytes * 0.99 <= kept <= weight_bytes + 512 * len(weights), live_blocks()
    pool = trainer._host_pool
    assert pool is not None and pool._buffer is not None
    assert pool._buffer.numel() == offload_bytes(trainer.model, trainer.optimizer, weights=False)
    trainer.onload()
    assert all(local(s).device.type == "cuda" for s in state_tensors(trainer))
    loss_2 = trainer.train(second, nll_loss)["loss"]
    after = {name: t.detach().cpu().clone() for name, t in trainer.iter_weights()}
    del trainer, weights, pool
    free_device()

    straight = PolicyTrainer(config, device="cuda:0")
    assert loss_1 == pytest.approx(straight.train(first, nll_loss)["loss"], rel=1e-5)
    assert loss_2 == pytest.approx(straight.train(second, nll_loss)["loss"], rel=1e-5)
    for name, tensor in straight.iter_weights():
        torch.testing.assert_close(after[name], tensor.cpu(), msg=name)
    del straight
    free_device()


def test_exact_size_pinned_memory_is_page_locked_and_copies_both_ways() -> None:
    """``tensors.pinned.pinned_bytes``: the bytes asked (torch's pinned allocator would round
    3 MiB + 5 up to 4 MiB), page-locked, non-blocking copies to the device and back exact."""
    from tandem.tensors.pinned import pinned_bytes

    size = 3 * 2**20 + 5
    host = pinned_bytes(size)
    assert host.numel() == size and host.is_pinned()
    host.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    device = host.to("cuda", non_blocking=True)
    back = pinned_bytes(size)
    back.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, host)


def test_storage_offload_moves_storages_carved_back_to_back_in_one_copy() -> None:
    """From the second offload on, the large storages that onload carved in order move in one
    copy each way (the small pool's in few), every value and object kept; a tensor allocated
    between the rounds is not touched."""
    from tandem.tensors.storage_offload import StorageOffload

    torch.manual_seed(0)
    cuda = torch.device("cuda")  # no index: the offload takes the current device's
    large = [torch.randn(3 * 2**18 + 7 * i + 1, device=cuda) for i in range(20)]  # ~3 MiB
    small = [torch.randn(100 + i, device=cuda) for i in range(5)]
    views = [t[1:5] for t in large]
    values = [t.clone() for t in large + small]
    ids = [id(t) for t in large + small + views]
    before = torch.randn(2**22, device=cuda)  # 16 MiB: a segment of its own, none left over
    previous = None
    for round_ in range(3):
        offload = StorageOffload(large + small + views, cuda, previous=previous)
        assert len(offload.holders) == 25
        offload.offload()
        release_device_caches()  # as the trainers do after an offload
        bystander = torch.randn(2**22, device=cuda)
        kept = [bystander.clone(), before.clone()]
        offload.onload()
        if round_:
            assert offload.copies["offload"] <= 1 + 5 and offload.copies["onload"] <= 1 + 5
            assert all(h is p for h, p in zip(offload.host, previous.host, strict=True))
        assert torch.equal(bystander, kept[0]) and torch.equal(before, kept[1])
        for tensor, value in zip(large + small, values, strict=True):
            assert torch.equal(tensor, value)
        assert [id(t) for t in large + small + views] == ids
        previous = offload
    views[0][0] = 7.0
    assert large[0][1] == 7.0


def test_storage_offload_onload_in_chunks_copies_within_each_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Onload reserving a segment per chunk of ~8 MiB: storages back to back across two
    segments (addresses may meet) move in separate copies, every value comes back, and from
    the second round on there are at most two copies per chunk (one where the allocator put
    some of its storages in a free block of another segment)."""
    from tandem.tensors import storage_offload
    from tandem.tensors.storage_offload import StorageOffload

    monkeypatch.setattr(storage_offload, "CHUNK", 8 * 2**20)
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    tensors = [torch.randn(2**19 + 128 * i + 3, device=cuda) for i in range(24)]  # ~2 MiB
    values = [t.clone() for t in tensors]
    previous = None
    for round_ in range(3):
        offload = StorageOffload(tensors, cuda, previous=previous)
        chunks = offload._chunks()
        assert len(chunks) == 6  # four ~2 MiB storages reach 8 MiB
        offload.offload()
        release_device_caches()
        offload.onload()
        for tensor in tensors:  # each lies in an allocation the onload knows of
            start = tensor.untyped_storage().data_ptr()
            end = start + tensor.untyped_storage().nbytes()
            assert any(low <= start and end <= high for low, high in offload.spans)
        # the allocator gives a storage the smallest free block that fits: one left in another
        # segment by earlier work (other tests' tensors) takes some of a chunk's storages, which
        # then move in a copy of their own; still far fewer copies than the 24 storages
        if round_:
            assert offload.copies["offload"] <= 2 * len(chunks)
        assert offload.copies["onload"] <= 2 * len(chunks)
        for tensor, value in zip(tensors, values, strict=True):
            assert torch.equal(tensor, value)
        previous = offload
