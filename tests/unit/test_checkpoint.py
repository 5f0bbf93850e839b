"""Trainer checkpoints (resume, atomicity under a crash) and Hugging Face export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from test_trainer_support import make_batch, policy, spawn, token_nll, write_tiny_qwen2

from tandem.checkpoint import hf_export, sharded
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.trainer import PolicyTrainer

SCHEDULE = OptimizerConfig(
    lr=1e-2, eps=1e-3, warmup_steps=2, schedule="cosine", total_steps=10, max_grad_norm=1.0
)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny"), tied=request.param)


def config(model_dir: Path) -> PolicyConfig:
    return policy(model_dir, micro_batch_size=3, optimizer=SCHEDULE)


def optimizer_state(trainer: PolicyTrainer) -> list[torch.Tensor]:
    assert trainer.optimizer is not None
    return [
        value
        for param in trainer.optimizer.param_groups[0]["params"]
        for value in trainer.optimizer.state[param].values()
    ]


def test_resume_continues_like_an_uninterrupted_run(model_dir: Path, tmp_path: Path) -> None:
    straight = PolicyTrainer(config(model_dir))
    for seed in range(3):
        straight.train(make_batch(seed), token_nll)
    straight.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 24, "seed": 7})
    resumed = PolicyTrainer(config(model_dir))
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"data_position": 24, "seed": 7}
    assert resumed.step == 3
    for (name, x), (_, y) in zip(straight.iter_weights(), resumed.iter_weights(), strict=True):
        assert torch.equal(x, y), name
    a_state, b_state = optimizer_state(straight), optimizer_state(resumed)
    assert len(a_state) == len(b_state) > 0
    assert all(torch.equal(a, b) for a, b in zip(a_state, b_state, strict=True))
    a, b = straight.train(make_batch(5), token_nll), resumed.train(make_batch(5), token_nll)
    assert a == b and a["lr"] < SCHEDULE.lr  # decaying: the schedule position was restored
    for (name, x), (_, y) in zip(straight.iter_weights(), resumed.iter_weights(), strict=True):
        assert torch.equal(x, y), name


def _die_mid_save(rank: int, world_size: int, model_dir: str, path: str) -> None:
    """Saves a checkpoint at step 0, trains, then dies (os._exit) after the new shards are
    written but before the save completes."""
    trainer = PolicyTrainer(config(Path(model_dir)))
    trainer.save_checkpoint(Path(path), extra={"step": 0})
    trainer.train(make_batch(), token_nll)
    real_save = sharded.dcp.save

    def save_then_die(*args: object, **kwargs: object) -> None:
        real_save(*args, **kwargs)
        os._exit(17)

    sharded.dcp.save = save_then_die  # type: ignore[assignment]  # the crash, injected
    trainer.save_checkpoint(Path(path), extra={"step": 1})


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    model_dir = write_tiny_qwen2(tmp_path / "tiny", tied=False)
    path = tmp_path / "ckpt"
    with pytest.raises(mp.ProcessExitedException):
        spawn(_die_mid_save, 1, str(model_dir), str(path))
    assert (tmp_path / "ckpt.tmp" / "shards").is_dir()  # the dead save's partial output
    trainer = PolicyTrainer(config(model_dir))
    assert trainer.load_checkpoint(path) == {"step": 0} and trainer.step == 0
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for name, tensor in trainer.iter_weights():
        assert torch.equal(tensor, original[name]), name
    trainer.train(make_batch(), token_nll)
    trainer.save_checkpoint(path, extra={"step": 1})  # clears the leftover
    assert not (tmp_path / "ckpt.tmp").exists()
    assert PolicyTrainer(config(model_dir)).load_checkpoint(path) == {"step": 1}


def test_death_between_the_renames_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    model_dir = write_tiny_qwen2(tmp_path / "tiny", tied=False)
    trainer = PolicyTrainer(config(model_dir))
    trainer.save_checkpoint(tmp_path / "ckpt", extra={"step": 0})
    os.replace(tmp_path / "ckpt", tmp_path / "ckpt.old")  # what a crash right after it leaves
    assert sharded.complete(tmp_path / "ckpt") == tmp_path / "ckpt.old"
    assert PolicyTrainer(config(model_dir)).load_checkpoint(tmp_path / "ckpt") == {"step": 0}
    trainer.save_checkpoint(tmp_path / "ckpt", extra={"step": 1})
    assert sharded.complete(tmp_path / "ckpt") == tmp_path / "ckpt"
    with pytest.raises(ValueError, match="no complete trainer checkpoint"):
        trainer.load_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="JSON"):
        trainer.save_checkpoint(tmp_path / "ckpt", extra={"rng": torch.zeros(1)})


@pytest.mark.parametrize("shard_bytes", [None, 200_000], ids=["one_file", "several_files"])
def test_export_hf_loads_with_transformers(
    model_dir: Path, tmp_path: Path, shard_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shard_bytes is not None:
        monkeypatch.setattr(hf_export, "SHARD_BYTES", shard_bytes)
    trainer = PolicyTrainer(config(model_dir))
    trainer.train(make_batch(), token_nll)
    trainer.export_hf(tmp_path / "hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "tokenizer_config.json" in files and not (tmp_path / "hf.tmp").exists()
    assert ("model.safetensors.index.json" in files) is (shard_bytes is not None)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_cache"] is True
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    batch = make_batch(3)
    with torch.no_grad():
        a = loaded(batch.input_ids, attention_mask=batch.attention_mask).logits
        b = trainer.lm(batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(a, b)
    exported = dict(trainer.iter_weights())
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in exported.items())


def test_a_tensor_learning_rate_saves_and_resumes(tmp_path: Path) -> None:
    """An optimizer whose learning rate is a tensor (torchao's, ``policy.optimizer.
    bf16_stochastic_round``) gives its scheduler tensor learning rates: the checkpoint keeps
    them as numbers, and the resumed schedule goes on where it stopped."""
    from tandem.checkpoint.state import TrainState
    from tandem.trainer.schedule import lr_factor

    def state() -> TrainState:
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1))
        factor = lr_factor(SCHEDULE, None)
        return TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor), 0)

    saved = state()
    for _ in range(3):
        saved.model(torch.ones(2, 4)).sum().backward()
        saved.optimizer.step()  # type: ignore[union-attr]
        saved.scheduler.step()  # type: ignore[union-attr]
    saved.step = 3
    sharded.save(saved, tmp_path / "ckpt", extra={})
    loaded = state()
    sharded.load(loaded, tmp_path / "ckpt")
    assert loaded.step == 3
    for _ in range(2):
        saved.scheduler.step()  # type: ignore[union-attr]
        loaded.scheduler.step()  # type: ignore[union-attr]
        lr = float(saved.optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]
        assert float(loaded.optimizer.param_groups[0]["lr"]) == pytest.approx(lr)  # type: ignore[union-attr]
        assert lr != pytest.approx(0.1)  # a schedule that moves: warm-up then cosine
