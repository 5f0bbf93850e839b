"""PolicyTrainer on CPU: logprobs, gradient accumulation, FSDP2 over 2 gloo ranks vs 1 rank,
checkpoint/resume and Hugging Face export."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from tandem.algorithms.losses import nll_loss
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.trainer import PolicyTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_batch(seed: int = 0, size: int = 8, width: int = 12) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (size, width), generator=gen)
    lengths = torch.randint(width // 2, width + 1, (size,), generator=gen)
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    loss_mask = attention.float()
    loss_mask[:, :4] = 0
    return TrainBatch(ids * attention, attention, loss_mask)


def policy(model_dir: Path, **kwargs) -> PolicyConfig:
    # a large eps keeps Adam from amplifying float rounding of near-zero gradients to ±lr
    optimizer = OptimizerConfig(lr=1e-2, eps=1e-3, max_grad_norm=1.0)
    return PolicyConfig(model_path=model_dir, optimizer=optimizer, **kwargs)


def test_logprobs_match_full_logits_and_ignore_chunk_size(model_dir: Path) -> None:
    batch = make_batch()
    trainer = PolicyTrainer(policy(model_dir, logprob_chunk_size=5))
    chunked, entropy = trainer.logprobs(batch, with_entropy=True)
    with torch.no_grad():
        logits = trainer.lm(batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits.float(), -1)
    expected = torch.zeros_like(chunked)
    expected[:, 1:] = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    expected *= batch.attention_mask
    assert torch.allclose(chunked, expected, atol=1e-6)
    ent = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(entropy[:, 1:], ent[:, :-1] * batch.attention_mask[:, 1:], atol=1e-5)
    trainer.model.chunk_size = 1000
    assert torch.allclose(trainer.logprobs(batch), chunked, atol=1e-6)


def test_micro_batches_equal_the_full_batch_step(model_dir: Path) -> None:
    batch = make_batch()
    full = PolicyTrainer(policy(model_dir, micro_batch_size=8))
    micro = PolicyTrainer(policy(model_dir, micro_batch_size=3))
    a, b = full.train(batch, nll_loss), micro.train(batch, nll_loss)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for (name, x), (_, y) in zip(full.iter_weights(), micro.iter_weights(), strict=True):
        assert torch.allclose(x, y, atol=1e-6), name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fsdp_rank(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = PolicyTrainer(policy(Path(model_dir)), rank=rank, world_size=world_size)
    shard = make_batch().select(slice(rank * 4, rank * 4 + 4))
    losses = [trainer.train(shard, nll_loss)["loss"] for _ in range(2)]
    weights = dict(trainer.iter_weights())
    ckpt = Path(out) / "ckpt"
    trainer.save_checkpoint(ckpt)
    if rank == 0:
        torch.save({"losses": losses, "weights": weights}, Path(out) / "result.pt")
    torch.distributed.destroy_process_group()


def test_fsdp_two_ranks_equal_one_rank(model_dir: Path, tmp_path: Path) -> None:
    mp.spawn(_fsdp_rank, args=(2, _free_port(), str(model_dir), str(tmp_path)), nprocs=2)
    result = torch.load(tmp_path / "result.pt")
    single = PolicyTrainer(policy(model_dir))
    losses = [single.train(make_batch(), nll_loss)["loss"] for _ in range(2)]
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    for name, tensor in single.iter_weights():
        assert torch.allclose(result["weights"][name], tensor, atol=1e-5), name
    assert (tmp_path / "ckpt").is_dir()
    assert not (tmp_path / "ckpt.tmp").exists()


def test_checkpoint_resume_continues_identically(model_dir: Path, tmp_path: Path) -> None:
    straight = PolicyTrainer(policy(model_dir))
    for seed in range(2):
        straight.train(make_batch(seed), nll_loss)
    straight.save_checkpoint(tmp_path / "ckpt")
    resumed = PolicyTrainer(policy(model_dir))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 2
    a, b = straight.train(make_batch(5), nll_loss), resumed.train(make_batch(5), nll_loss)
    assert a["loss"] == b["loss"] and a["lr"] == b["lr"]
    for (name, x), (_, y) in zip(straight.iter_weights(), resumed.iter_weights(), strict=True):
        assert torch.equal(x, y), name


def test_interrupted_save_keeps_previous_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    trainer = PolicyTrainer(policy(model_dir))
    trainer.save_checkpoint(tmp_path / "ckpt")
    before = sorted(p.name for p in (tmp_path / "ckpt").rglob("*"))
    trainer.optimizer = "not an optimizer"  # type: ignore[assignment]  # makes the save fail
    with pytest.raises(Exception):  # noqa: B017 - any failure mid-save
        trainer.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*")) == before


def test_export_hf_loads_with_transformers(model_dir: Path, tmp_path: Path) -> None:
    trainer = PolicyTrainer(policy(model_dir))
    trainer.train(make_batch(), nll_loss)
    trainer.export_hf(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    batch = make_batch(3)
    with torch.no_grad():
        a = loaded(batch.input_ids).logits
        b = trainer.lm(batch.input_ids).logits
    assert torch.allclose(a, b, atol=1e-6)
