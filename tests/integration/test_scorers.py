"""Models beside the policy in a GRPO run: a reward model, a judge and a teacher, in this process
and as Ray actors; what a user sees when one is wrong, dies or hangs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cli import main
from tandem.cluster.groups import WorkerError
from tandem.cluster.scorers import model_scorers
from tandem.config import GrpoConfig, load_config

SMALL_RUN = [
    "algorithm.prompts_per_step=4",
    "algorithm.num_generations=4",
    "algorithm.eval_every=0",
    "generation.backend=hf",
    "checkpoint.enabled=false",
    "logging.progress=false",
]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model with a one-label score head (drawn from seed 0), exported."""
    from tandem.trainer.reward_model import RewardModel

    path = tmp_path_factory.mktemp("rm") / "hf"
    RewardModel(DEFAULT_MODEL_DIR, seed=0).export_hf(path)
    return path


def _records(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_in_process_with_a_reward_model_a_judge_and_a_teacher(
    tmp_path: Path, reward_model: Path
) -> None:
    args = [
        "grpo",
        *SMALL_RUN,
        "algorithm.num_steps=2",
        "cluster.runtime=in_process",
        f"reward.model={reward_model}",
        "reward.model_weight=0.5",
        f"reward.judge={DEFAULT_MODEL_DIR}",
        "reward.judge_weight=2.0",
        f"algorithm.teacher={DEFAULT_MODEL_DIR}",
        f"logging.run_dir={tmp_path}",
        "logging.name=run",
    ]
    assert main(args) == 0
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the reward is the weighted sum of its parts, so its mean is that of their means
        parts = r["reward/rule_mean"] + 0.5 * r["reward/model_mean"] + 2.0 * r["reward/judge_mean"]
        assert r["train/reward_mean"] == pytest.approx(parts, rel=1e-5, abs=1e-5)
        assert 0 <= r["reward/judge_unparseable_count"] <= 16
        assert r["timing/teacher_s"] > 0
    # the teacher is the student's starting point: before the first update they agree
    assert abs(records[0]["distill/reverse_kl"]) < 1e-4


def test_a_teacher_with_another_vocabulary_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    teacher = tmp_path / "teacher"
    shutil.copytree(DEFAULT_MODEL_DIR, teacher)
    for item in teacher.glob("*token*"):
        item.unlink()
    vocab = {"<eos>": 0, **{str(d): d + 1 for d in range(10)}, "+": 11, "-": 12, "=": 13}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>").save_pretrained(teacher)
    args = ["grpo", f"algorithm.teacher={teacher}", f"logging.run_dir={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"algorithm.teacher={teacher} does not share the student's tokenizer" in err
    assert f"policy.model_path={DEFAULT_MODEL_DIR}" in err
    assert "Traceback" not in err


def test_bad_reward_models_and_judge_templates_are_user_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["grpo", f"logging.run_dir={tmp_path}"]
    assert main([*base, f"reward.model={DEFAULT_MODEL_DIR}"]) == 2
    assert "no sequence-classification head" in capsys.readouterr().err
    template = "reward.judge_template=Grade {prompt}:"
    assert main([*base, f"reward.judge={DEFAULT_MODEL_DIR}", template]) == 2
    assert "reward.judge_template lacks {response}" in capsys.readouterr().err


def _ray_config(reward_model: Path, *overrides: str) -> GrpoConfig:
    return load_config(
        GrpoConfig,
        None,
        [
            "cluster.runtime=ray",
            "cluster.env_mode=shared",
            "cluster.cpus_per_actor=0.5",
            f"reward.model={reward_model}",
            *overrides,
        ],
    )


@pytest.mark.ray
@pytest.mark.slow
def test_a_reward_model_actor_scores_as_this_process_does(
    ray_cluster: None, reward_model: Path
) -> None:
    from tandem.trainer.reward_model import RewardModel

    prompts, responses = ["17+25=", "3+4=", "9-9="], ["42", "8", ""]
    with model_scorers(_ray_config(reward_model, "reward.rule_weight=0")) as scorers:
        assert scorers is not None
        from tandem.rewards.scorer import Scores

        samples = [(p, r, "0") for p, r in zip(prompts, responses, strict=True)]
        scored = scorers.score(samples, Scores([1.0, 0.0, 1.0]))
    here = RewardModel(reward_model).score(prompts, responses)
    assert scored.rewards == pytest.approx(here, abs=1e-5)  # rule_weight 0: the model alone
    assert scored.metrics["reward/rule_mean"] == pytest.approx(2 / 3)


@pytest.mark.ray
@pytest.mark.slow
def test_a_reward_model_actor_that_dies_or_hangs_is_named(
    ray_cluster: None, reward_model: Path
) -> None:
    import ray

    from tandem.rewards.scorer import Scores

    sample = [("1+1=", "2", "2")]
    with model_scorers(_ray_config(reward_model)) as scorers:
        assert scorers is not None
        actor = scorers.groups["reward_model"].actors[0]  # type: ignore[attr-defined]
        ray.kill(actor, no_restart=True)
        with pytest.raises(WorkerError, match=r"reward_model worker rank 0 failed in score\(\)"):
            scorers.score(sample, Scores([1.0]))
    with model_scorers(_ray_config(reward_model, "reward.timeout_s=0.001")) as scorers:
        assert scorers is not None
        hangs = r"reward_model .* no result after 0.001 s \(reward.timeout_s\)"
        with pytest.raises(WorkerError, match=hangs):
            scorers.score(sample, Scores([1.0]))


@pytest.mark.ray
@pytest.mark.slow
def test_grpo_through_ray_places_the_reward_model_in_the_runs_placement(
    ray_cluster: None, tmp_path: Path, reward_model: Path
) -> None:
    """The run reserves a slot for its reward model (colocated: a share of bundle 0) and the
    actor starts there: a step through Ray scores with it."""
    import ray

    from tandem.cluster.placement import create_placement

    placement = create_placement("colocated", 1, 1, cpus_per_actor=0.5, num_scorers=1)
    try:
        (slot,) = placement.scorer_bundles
        assert (slot.bundle_index, slot.num_cpus) == (0, 0.5)
        with model_scorers(_ray_config(reward_model), placement.scorer_bundles) as scorers:
            assert scorers is not None
            actor = scorers.groups["reward_model"].actors[0]  # type: ignore[attr-defined]
            where = actor.__ray_call__.remote(
                lambda _: ray.get_runtime_context().get_placement_group_id()
            )
            assert ray.get(where) == placement.placement_group.id.hex()
    finally:
        placement.remove()
    args = [
        "grpo",
        *SMALL_RUN,
        "algorithm.num_steps=1",
        "cluster.runtime=ray",
        "cluster.env_mode=shared",
        "cluster.cpus_per_actor=0.5",
        f"reward.model={reward_model}",
        f"logging.run_dir={tmp_path}",
        "logging.name=run",
    ]
    assert main(args) == 0
    (record,) = _records(tmp_path / "run")
    assert -10 < record["reward/model_mean"] < 10
