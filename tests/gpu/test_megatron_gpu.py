"""The Megatron-core trainer on a GPU against the FSDP2 trainer on the embedded model (its 257
ids padded to 384: the padded logits must stay out of every softmax): logprobs, entropies, the
loss and the step, fp32; offload leaves nothing of it on the device and keeps every object."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tandem.algorithms.losses import nll_loss
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.tensors.devices import release_device_caches
from tandem.trainer import PolicyTrainer

megatron = pytest.importorskip("megatron.core", reason="needs megatron-core (the megatron extra)")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", autouse=True)
def megatron_groups(process_group: None) -> Iterator[None]:
    """Megatron's model-parallel groups live in module globals: dropped before the process
    group goes (``process_group``'s teardown); so do its memoised rotary tables of trainers
    that were never offloaded (the next module checks that no test left device memory)."""
    yield
    from megatron.core import parallel_state

    from tandem.trainer.megatron_trainer import _clear_megatron_caches

    _clear_megatron_caches()
    parallel_state.destroy_model_parallel()


def config(**extra: Any) -> PolicyConfig:
    return PolicyConfig(optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=2, **extra)


def batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 257, (3, 24), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 17:] = 0
    attention[2, 9:] = 0
    loss_mask = attention.float()
    loss_mask[:, :5] = 0
    return TrainBatch(ids * attention, attention, loss_mask)


def test_megatron_matches_fsdp2_fp32() -> None:
    from tandem.trainer.megatron_trainer import MegatronTrainer

    data = batch()
    mask = data.attention_mask.float()
    ref = PolicyTrainer(config(), device="cuda:0")
    meg = MegatronTrainer(config(backend="megatron"), device="cuda:0")
    (a, ea), (b, eb) = meg.logprobs(data, True), ref.logprobs(data, True)
    # logprobs near -17 here: 2e-5 is ~10 float32 ulps (1.05e-5 measured on an H200; the two
    # attention kernels sum in different orders)
    assert float(((a - b).abs() * mask).max()) <= 2e-5
    assert float(((ea - eb).abs() * mask).max()) <= 1e-4
    # megatron-core's torch AdamW fallback steps with torch's fused kernel on CUDA
    assert all(g["fused"] for opt in meg.inner_optimizers() for g in opt.param_groups)
    ma, mb = meg.train(data, nll_loss), ref.train(data, nll_loss)
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-5)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
    after = float(((meg.logprobs(data) - ref.logprobs(data)).abs() * mask).max())
    assert after <= 1e-3  # one AdamW step at lr 1e-3 from equal gradients
    names = [name for name, _, _ in meg.weight_metadata()]
    assert [name for name, _ in meg.iter_weights()] == names
    assert sorted(names) == sorted(name for name, _ in ref.iter_weights())


def test_megatron_offload_leaves_nothing_and_keeps_objects() -> None:
    from tandem.trainer.megatron_trainer import MegatronTrainer

    gc.collect()
    release_device_caches()  # an earlier test's cuBLAS workspaces: offload() frees them too
    before = torch.cuda.memory_allocated()
    data = batch()
    trainer = MegatronTrainer(config(backend="megatron", dtype="bfloat16"), device="cuda:0")
    trainer.train(data, nll_loss)  # the optimizer state exists after a step
    expected = trainer.logprobs(data)
    objects = [id(p) for p in trainer.model.parameters()]
    trainer.offload()
    # nothing of it stays; less than before where its offload also dropped what Megatron
    # caches for every model in the process (rotary tables an earlier test's trainer made)
    assert torch.cuda.memory_allocated() <= before
    trainer.onload()
    assert [id(p) for p in trainer.model.parameters()] == objects
    assert torch.equal(trainer.logprobs(data), expected)
    trainer.train(data, nll_loss)  # and it trains on


def test_megatron_checkpoint_resumes_bit_for_bit(tmp_path: Any) -> None:
    """Save after a step; the next step from the checkpoint (a new trainer, the fused Adam's
    device-held step counters loaded back) equals the next step of the trainer that saved."""
    from tandem.trainer.megatron_trainer import MegatronTrainer

    data = batch()
    first = MegatronTrainer(config(backend="megatron"), device="cuda:0")
    first.train(data, nll_loss)
    first.save_checkpoint(tmp_path / "ckpt", extra={"seen": 1})
    first.train(data, nll_loss)
    expected = first.logprobs(data)
    del first
    gc.collect()
    second = MegatronTrainer(config(backend="megatron"), device="cuda:0")
    assert second.load_checkpoint(tmp_path / "ckpt") == {"seen": 1}
    assert second.step == 1
    second.train(data, nll_loss)
    assert torch.equal(second.logprobs(data), expected)
