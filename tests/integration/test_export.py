"""The trained policy comes out of a GRPO run as a Hugging Face folder (``<run>/hf``), and
``tandem export`` writes the same folder from any checkpoint: transformers loads it and gives
the trainer's logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_grpo import small_config

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cli import main
from tandem.config import PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.driver import run_grpo
from tandem.trainer.policy_trainer import PolicyTrainer

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]


def _batch() -> TrainBatch:
    ids = torch.tensor([[5, 17, 30, 2, 9, 41, 3], [7, 7, 12, 19, 4, 0, 0]])
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    return TrainBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.float())


def _transformers_logprobs(folder: Path, batch: TrainBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1)
    picked = logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0)) * batch.attention_mask


def test_grpo_exports_the_trained_policy_and_tandem_export_matches(
    ray_cluster: None, tmp_path: Path
) -> None:
    run_grpo(small_config(tmp_path, "run", "algorithm.num_steps=2", "algorithm.eval_every=0"))
    run = tmp_path / "run"
    exported = run / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).is_file(), name
    trained = load_file(str(exported / "model.safetensors"))
    initial = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors"))
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)  # it was trained

    assert main(["export", str(run), str(tmp_path / "again")]) == 0
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    for name, tensor in trained.items():
        assert torch.equal(tensor, again[name]), name

    # the trainer (rebuilt from the checkpoint) and transformers on the export agree
    trainer = PolicyTrainer(PolicyConfig(model_path=DEFAULT_MODEL_DIR), device="cpu")
    latest = (run / "checkpoints" / "latest").read_text().strip()
    trainer.load_checkpoint(run / "checkpoints" / latest / "trainer")
    batch = _batch()
    expected = trainer.logprobs(batch) * batch.attention_mask
    got = _transformers_logprobs(exported, batch)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
