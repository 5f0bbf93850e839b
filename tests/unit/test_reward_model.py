"""Reward models: the Bradley-Terry loss, the trainer on the embedded model, its checkpoint and
export (loaded back by transformers), and ``tandem rm`` as a user runs it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tandem.algorithms.bradley_terry import bradley_terry
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.scorers import check_reward_model, is_reward_model
from tandem.config.models import OptimizerConfig
from tandem.trainer.reward_model import RewardModel, RewardModelTrainer

PAIRS = [
    {"prompt": "17+25=", "chosen": "42", "rejected": "45"},
    {"prompt": "3+4=", "chosen": "7", "rejected": "9"},
    {"prompt": "50-8=", "chosen": "42", "rejected": "52"},
    {"prompt": "11+11=", "chosen": "22", "rejected": "21"},
]


def test_bradley_terry_by_hand() -> None:
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    loss, metrics = bradley_terry(chosen, rejected)
    by_hand = [math.log1p(math.exp(-m)) for m in (2.0, 0.0, -2.0)]
    assert float(loss) == pytest.approx(sum(by_hand) / 3, rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(1 / 3)  # a tie is not a win
    assert metrics["margin"] == pytest.approx(0.0)


def _trainer(lr: float = 3e-3, steps: int = 40) -> RewardModelTrainer:
    return RewardModelTrainer(DEFAULT_MODEL_DIR, OptimizerConfig(lr=lr), total_steps=steps)


def test_the_trainer_fits_pairs_it_trains_on() -> None:
    torch.set_num_threads(1)
    trainer = _trainer()
    before = trainer.evaluate(PAIRS)
    for _ in range(40):
        trainer.train_step(PAIRS)
    after = trainer.evaluate(PAIRS)
    assert after["loss"] < before["loss"] - 0.2
    assert after["accuracy"] == 1.0


def test_trainable_layers_trains_the_top_layers_and_the_head_only() -> None:
    """``model.trainable_layers: 1`` on the 4-layer embedded model: one step moves the last
    layer, the final norm and the score head; the embeddings and layers 0-2 stay as loaded, and
    the optimizer holds only what trains."""
    torch.set_num_threads(1)
    trainer = RewardModelTrainer(
        DEFAULT_MODEL_DIR, OptimizerConfig(lr=1e-2), total_steps=1, trainable_layers=1
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train_step(PAIRS)
    moved = {
        name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])
    }
    assert "score.weight" in moved and "model.norm.weight" in moved
    assert any(name.startswith("model.layers.3.") for name in moved)
    assert all(name.startswith(("model.layers.3.", "model.norm", "score")) for name in moved)
    trained = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
    assert trained == sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert trained < sum(p.numel() for p in trainer.model.parameters()) / 3
    # more layers than the model has: every layer trains
    every = RewardModelTrainer(
        DEFAULT_MODEL_DIR, OptimizerConfig(), total_steps=1, trainable_layers=9
    )
    assert all(p.requires_grad for p in every.model.model.layers.parameters())


def test_unfreeze_after_trains_every_parameter_from_that_step_and_resumes(
    tmp_path: Path,
) -> None:
    """``model.unfreeze_after: 1``: step 1 trains the top layer only, step 2 every parameter
    (a fresh optimizer at ``unfreeze_lr``); a checkpoint written after it resumes into a trainer
    that trains every parameter with the saved optimizer state."""
    torch.set_num_threads(1)

    def trainer() -> RewardModelTrainer:
        return RewardModelTrainer(
            DEFAULT_MODEL_DIR,
            OptimizerConfig(lr=1e-2),
            total_steps=4,
            trainable_layers=1,
            unfreeze_after=1,
            unfreeze_lr=1e-3,
        )

    first = trainer()
    embeddings = first.model.model.embed_tokens.weight
    before = embeddings.detach().clone()
    first.train_step(PAIRS)
    assert torch.equal(embeddings, before)
    metrics = first.train_step(PAIRS)
    assert not torch.equal(embeddings, before)
    assert metrics["lr"] == pytest.approx(1e-3)  # unfreeze_lr, not the first 1e-2
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = trainer()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.unfrozen and resumed.steps_done == 2
    counted = sum(p.numel() for g in resumed.optimizer.param_groups for p in g["params"])
    assert counted == sum(p.numel() for p in resumed.model.parameters())
    assert (
        resumed.optimizer.state_dict()["state"].keys()
        == first.optimizer.state_dict()["state"].keys()
    )


def test_chosen_lm_coef_adds_the_causal_lm_loss_of_the_chosen_responses() -> None:
    """``algorithm.chosen_lm_coef``: the first step's ``chosen_lm_loss`` is the causal LM's own
    mean cross-entropy of the chosen responses' tokens (the backbone is still the LM's), and the
    step's loss is the Bradley-Terry loss plus coef times it."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    lm = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR))
    tokenizer = RewardModel(DEFAULT_MODEL_DIR).tokenizer
    losses, tokens = 0.0, 0
    for pair in PAIRS:
        prompt = tokenizer.encode(pair["prompt"], add_special_tokens=False)
        ids = tokenizer.encode(pair["prompt"] + pair["chosen"], add_special_tokens=False)
        with torch.no_grad():
            logprobs = lm(torch.tensor([ids])).logits[0].log_softmax(-1)
        for position in range(len(prompt), len(ids)):
            losses -= float(logprobs[position - 1, ids[position]])
            tokens += 1
    plain = RewardModelTrainer(DEFAULT_MODEL_DIR, OptimizerConfig(lr=1e-3), total_steps=1)
    with_lm = RewardModelTrainer(
        DEFAULT_MODEL_DIR, OptimizerConfig(lr=1e-3), total_steps=1, chosen_lm_coef=0.5
    )
    bt_only = plain.train_step(PAIRS)
    metrics = with_lm.train_step(PAIRS)
    assert "chosen_lm_loss" not in bt_only
    assert metrics["chosen_lm_loss"] == pytest.approx(losses / tokens, rel=1e-4)
    assert metrics["loss"] == pytest.approx(bt_only["loss"], rel=1e-5)  # the Bradley-Terry part
    assert metrics["grad_norm"] != pytest.approx(bt_only["grad_norm"])


def test_chosen_lm_coef_refuses_a_model_with_its_own_output_layer(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(DEFAULT_MODEL_DIR))
    config.tie_word_embeddings = False
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"algorithm\.chosen_lm_coef needs .*tie_word_embeddings"):
        RewardModelTrainer(tmp_path, OptimizerConfig(), total_steps=1, chosen_lm_coef=1.0)
    RewardModelTrainer(tmp_path, OptimizerConfig(), total_steps=1)  # without it: accepted


def test_score_init_zero_starts_every_score_at_zero_and_keeps_a_trained_head(
    tmp_path: Path,
) -> None:
    """``model.score_init: zero``: a fresh head scores every text 0, so the first step moves the
    head alone (the backbone's gradient is the head's weight: zero); a reward model's own head
    is loaded as it was."""
    torch.set_num_threads(1)
    trainer = RewardModelTrainer(
        DEFAULT_MODEL_DIR, OptimizerConfig(lr=1e-2), total_steps=2, score_init="zero"
    )
    assert trainer.fresh_head
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(PAIRS)
    assert metrics["chosen_score"] == 0.0 and metrics["rejected_score"] == 0.0
    moved = {
        name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])
    }
    assert moved == {"score.weight"}
    trainer.train_step(PAIRS)
    assert any(
        n.startswith("model.layers.")
        for n, p in trainer.model.named_parameters()
        if not torch.equal(p, before[n])
    )
    trainer.export_hf(tmp_path / "hf")
    again = RewardModelTrainer(tmp_path / "hf", OptimizerConfig(), total_steps=1, score_init="zero")
    assert not again.fresh_head
    assert torch.equal(again.model.score.weight, trainer.model.score.weight)


def test_scores_do_not_depend_on_batching_or_padding() -> None:
    model = RewardModel(DEFAULT_MODEL_DIR, seed=3)
    prompts = [p["prompt"] for p in PAIRS]
    responses = ["42", "7 and a much longer response", "", "22"]
    together = model.score(prompts, responses, batch_size=4)
    alone = [model.score([p], [r])[0] for p, r in zip(prompts, responses, strict=True)]
    assert together == pytest.approx(alone, abs=1e-5)


def test_checkpoint_resume_and_export(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(1)
    trainer = _trainer()
    for _ in range(3):
        trainer.train_step(PAIRS)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    expected = trainer.train_step(PAIRS)

    resumed = _trainer()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    again = resumed.train_step(PAIRS)
    assert again["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert again["lr"] == expected["lr"]

    resumed.export_hf(tmp_path / "hf")
    assert is_reward_model(tmp_path / "hf")
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf"))
    batch = resumed.encode(["17+25="], ["42"])
    with torch.no_grad():
        theirs = float(loaded(**batch).logits[0, 0])
    assert theirs == pytest.approx(resumed.score(["17+25="], ["42"])[0], abs=1e-5)
    check_reward_model(tmp_path / "hf", "reward.model")  # accepted


def test_a_causal_lm_is_refused_as_a_reward_model() -> None:
    assert not is_reward_model(DEFAULT_MODEL_DIR)
    with pytest.raises(ValueError, match=r"reward\.model=.*no sequence-classification head"):
        check_reward_model(DEFAULT_MODEL_DIR, "reward.model")


def test_tandem_rm_trains_evaluates_exports_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.cli import main

    args = [
        "rm",
        "model.threads=1",
        "algorithm.batch_size=8",
        "algorithm.eval_every=2",
        "data.num_eval_pairs=16",
        "checkpoint.every=2",
        f"logging.run_dir={tmp_path}",
        "logging.name=rm",
        "logging.progress=false",
    ]
    assert main([*args, "algorithm.num_steps=2"]) == 0
    run = tmp_path / "rm"
    assert is_reward_model(run / "hf")
    assert main([*args, "algorithm.num_steps=4", "--resume"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert all("train/chosen_lm_loss" in r for r in records if r["step"] > 0)  # the recipe's
    evaluated = [r["step"] for r in records if "eval/preference_accuracy" in r]
    assert evaluated == [0, 2, 4]
    assert all(0.0 <= r["eval/preference_accuracy"] <= 1.0 for r in records if r["step"] in (0, 4))
    capsys.readouterr()
    # a fresh run into the same folder is refused with one message (exit 2)
    assert main([*args, "algorithm.num_steps=2"]) == 2
    assert "holds an earlier run" in capsys.readouterr().err


def test_unfreeze_after_without_trainable_layers_is_a_config_error() -> None:
    from tandem.config.load import ConfigError, load_config
    from tandem.config.reward_model import RmConfig

    with pytest.raises(ConfigError, match=r"model\.unfreeze_after needs model\.trainable_layers"):
        load_config(RmConfig, None, ["model.unfreeze_after=5"])
    config = load_config(RmConfig, None, ["model.unfreeze_after=5", "model.trainable_layers=1"])
    assert config.model.unfreeze_after == 5


def test_the_rm_recipe_holds_out_one_pair_per_held_out_problem() -> None:
    from tandem.config.load import load_config
    from tandem.config.reward_model import RmConfig
    from tandem.data.arithmetic import ArithmeticTask
    from tandem.data.preferences import load_pairs

    config = load_config(RmConfig, "rm_arithmetic")
    _, held_out, prompts = load_pairs(config.data, config.algorithm.seed, num_train=8)
    problems = ArithmeticTask(seed=0).num_eval_problems
    assert len(held_out) == len({p["prompt"] for p in held_out}) == problems
    assert all(p["chosen"] != p["rejected"] for p in held_out)
    assert {p["prompt"] for p in prompts} == {p["prompt"] for p in held_out}


def test_the_chosen_lm_loss_forms_chunks_and_matches_full_logits() -> None:
    """The LM term's value and gradients equal the cross-entropy of full ``[rows, tokens,
    vocabulary]`` logits (fp32: the value 1e-6 absolute; gradients, up to 1.9 here, 1e-5 relative
    or 5e-6 absolute: fp32's own error, the full-logits gradients are 2.9e-6 from fp64's) when
    its head runs two tokens at a time."""
    torch.set_num_threads(1)
    trainer = RewardModelTrainer(
        DEFAULT_MODEL_DIR, OptimizerConfig(lr=1e-3), total_steps=1, chosen_lm_coef=1.0
    )
    trainer.lm_chunk_tokens = 2
    batch = trainer.encode([p["prompt"] for p in PAIRS], [p["chosen"] for p in PAIRS])
    hidden = trainer.model.base_model(**batch)[0]
    chunked = trainer._chosen_lm_loss(hidden, batch, PAIRS)
    weight = trainer.model.get_input_embeddings().weight
    logits = hidden[:, :-1] @ weight.T
    labels = batch["input_ids"][:, 1:].clone()
    for row, pair in enumerate(PAIRS):  # the prompt's tokens and the padding are not trained
        start = len(trainer.tokenizer.encode(pair["prompt"], add_special_tokens=False))
        end = int(batch["attention_mask"][row].sum())
        keep = torch.zeros_like(labels[row], dtype=torch.bool)
        keep[start - 1 : end - 1] = True
        labels[row, ~keep] = -100
    full = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads_chunked = torch.autograd.grad(chunked, params, retain_graph=True, allow_unused=True)
    grads_full = torch.autograd.grad(full, params, allow_unused=True)
    assert float(chunked.detach()) == pytest.approx(float(full.detach()), abs=1e-6)
    compared = 0
    for a, b in zip(grads_chunked, grads_full, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
            compared += 1
    assert compared > 10
