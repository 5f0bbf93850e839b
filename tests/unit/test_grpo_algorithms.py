"""The GRPO step's algorithm variants, end to end in one process (the real trainer and the
transformers generator as plain workers under the runtime): several updates per batch, dynamic
sampling with refill, REINFORCE++ with the KL in the rewards, GSPO and the rollout corrections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem.algorithms.grpo import grpo_step
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.cluster.groups import LocalGroup
from tandem.cluster.runtime import Runtime
from tandem.config import GrpoConfig, load_config
from tandem.data.prompts import make_prompt_source
from tandem.rewards import load_reward


def length_parity(prompt: str, response: str, answer: str) -> float:
    """A reward that is constant (0) on the prompts whose first character is odd and varies with
    the response elsewhere: about half the groups carry no signal (``data.reward`` of the
    refill test)."""
    if ord(prompt[0]) % 2:
        return 0.0
    return float(sum(map(ord, response)) % 2)


def _config(tmp_path: Path, *overrides: str) -> GrpoConfig:
    return load_config(
        GrpoConfig,
        "grpo_arithmetic",
        [
            "generation.backend=hf",
            "algorithm.prompts_per_step=4",
            "algorithm.num_generations=4",
            "policy.micro_batch_size=16",
            f"logging.run_dir={tmp_path}",
            *overrides,
        ],
    )


class CountingTrainer(TrainerWorker):
    """The real trainer worker, counting its train and logprob calls."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.calls: list[tuple[str, int]] = []

    def train(self, batch: Any, loss_fn: Any) -> dict[str, float]:
        self.calls.append(("train", batch.num_sequences))
        return super().train(batch, loss_fn)

    def logprobs(self, batch: Any) -> Any:
        self.calls.append(("logprobs", batch.num_sequences))
        return super().logprobs(batch)


class CountingGenerator(GeneratorWorker):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.prompts_seen: list[int] = []

    def generate_timed(self, prompt_token_ids: list[list[int]], params: Any) -> Any:
        self.prompts_seen.append(len(prompt_token_ids))
        return super().generate_timed(prompt_token_ids, params)


def _run(config: GrpoConfig, steps: int = 2) -> tuple[list[dict[str, float]], Any, Any]:
    kl = config.algorithm.kl_coef > 0
    trainer = CountingTrainer(
        policy=config.policy,
        refit=config.refit.model_copy(update={"transport": "colocated"}),
        generation=config.generation,
        with_reference=kl,
        total_steps=config.algorithm.num_steps
        * config.algorithm.ppo_epochs
        * config.algorithm.num_minibatches,
    )
    generator = CountingGenerator(generation=config.generation, model_path=str(DEFAULT_MODEL_DIR))
    source = make_prompt_source(
        config.data, config.policy.model_path, load_reward(config.data.reward), seed=0
    )
    runtime = Runtime(
        LocalGroup([trainer], "trainer"),
        LocalGroup([generator], "generator"),
        memory_phases=False,
        discards_weights=False,
        with_reference=kl,
    )
    n = config.algorithm.prompts_per_step
    with runtime:
        metrics = [
            grpo_step(runtime, config, source.train_prompts(s, n), s, source).metrics
            for s in range(1, steps + 1)
        ]
    return metrics, trainer, generator


def test_ppo_epochs_and_minibatches(tmp_path: Path) -> None:
    config = _config(tmp_path, "algorithm.ppo_epochs=2", "algorithm.num_minibatches=2")
    metrics, trainer, _ = _run(config)
    # per step: one old-logprob pass over the 16 rows, then 2 epochs x 2 minibatches of 8
    assert trainer.calls == 2 * [("logprobs", 16), *4 * [("train", 8)]]
    for m in metrics:
        assert m["train/updates"] == 4.0
        assert m["gen/logprob_mismatch"] < 1e-4  # the old policy is the generator's
    assert trainer.policy.step == 8


def test_one_update_per_batch_has_no_logprob_pass(tmp_path: Path) -> None:
    metrics, trainer, _ = _run(_config(tmp_path))
    assert trainer.calls == [("train", 16), ("train", 16)]
    assert all(m["train/updates"] == 1.0 for m in metrics)


def test_dynamic_sampling_refills_until_the_batch_is_full(tmp_path: Path) -> None:
    # exact_match on an untrained model: many groups score all 0 and are dropped
    config = _config(
        tmp_path,
        "algorithm.filter_zero_variance_groups=true",
        "algorithm.refill_rounds=3",
        "data.reward=test_grpo_algorithms:length_parity",
    )
    metrics, trainer, generator = _run(config, steps=1)
    rounds = int(metrics[0]["train/refill_rounds"])
    assert 1 <= rounds <= 3 and len(generator.prompts_seen) == rounds + 1
    assert generator.prompts_seen[0] == 4 and all(n <= 4 for n in generator.prompts_seen[1:])
    kept = trainer.calls[-1][1] // 4  # groups trained on
    assert kept == 4 or rounds == 3  # full, or the rounds ran out
    assert metrics[0]["train/kept_group_frac"] == pytest.approx(kept / sum(generator.prompts_seen))


def test_reinforce_pp_gspo_and_corrections_train(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "algorithm.advantage=reinforce_pp",
        "algorithm.kl_coef=0.05",
        "algorithm.policy_loss=gspo",
        "algorithm.aggregation=sequence",
        "algorithm.clip_low=0.0003",
        "algorithm.clip_high=0.0004",
        "algorithm.rollout_correction=icepop",
    )
    metrics, _, _ = _run(config)
    for m in metrics:
        assert m["rollout_correction/masked_frac"] < 0.05  # refits keep the two sides close
        assert m["train/kl"] >= 0.0 and m["train/grad_norm"] > 0
