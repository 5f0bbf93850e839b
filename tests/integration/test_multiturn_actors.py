"""Multi-turn rollouts with real Ray environment actors: environments that raise or hang end
their episodes with a counted error and the pool goes on; a short GRPO run of the multi-turn
recipes (guess_number with each generator backend, arithmetic_feedback with vLLM)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from workers import TESTS_DIR

from tandem.algorithms.multiturn import EpisodeLimits, episode_metrics, run_episodes
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.env_pool import EnvironmentPool
from tandem.config import GrpoConfig, load_config
from tandem.config.models import GenerationConfig
from tandem.data.turns import TurnEncoder
from tandem.generation import SamplingParams, make_generator

pytestmark = [pytest.mark.ray]

ENV = {"PYTHONPATH": TESTS_DIR}
SAMPLES = [
    {"prompt": "17+25=", "answer": "a"},
    {"prompt": "3-1=", "answer": "bad"},
    {"prompt": "5+5=", "answer": "hang"},
]


def pool(**kwargs: object) -> EnvironmentPool:
    return EnvironmentPool(
        "scripted_envs:ScriptedEnv",
        kwargs,
        num_workers=2,
        step_timeout_s=3.0,
        env_mode="shared",
        env_vars=ENV,
    )


def test_raising_and_hanging_environments_end_their_episodes_only(ray_cluster) -> None:
    generator = make_generator(GenerationConfig(backend="hf"), DEFAULT_MODEL_DIR)
    envs = pool(done_after=2, fail="step", hang_s=600.0)
    try:
        start = time.perf_counter()
        episodes = run_episodes(
            SAMPLES,
            2,
            generator.generate,
            envs,
            TurnEncoder(generator.tokenizer),
            SamplingParams(max_tokens=4, seed=0),
            EpisodeLimits(max_turns=3, max_tokens=100),
        )
        assert time.perf_counter() - start < 60  # the hung steps cost their timeout, once
        ok, bad, hung = episodes[0:2], episodes[2:4], episodes[4:6]
        assert all(e.end == "env" and e.reward == 1.0 and e.num_turns == 2 for e in ok)
        assert all(e.end == "error" and "failed on purpose" in (e.error or "") for e in bad)
        assert all(e.end == "error" and "timed out" in (e.error or "") for e in hung)
        assert episode_metrics(episodes)["env/errors"] == 4
        # both actors held a hung episode (episodes 4, 5): both were replaced, and they work
        assert envs.num_restarts == 2
        replies = envs.reset([(0, SAMPLES[0]), (1, SAMPLES[0])])
        assert [r.observation for r in replies] == ["17+25=", "17+25="]
        assert [r.error for r in envs.step([(0, "x"), (1, "x")])] == [None, None]
    finally:
        envs.shutdown()


def test_an_environment_that_cannot_be_built_is_an_episode_error(ray_cluster) -> None:
    envs = pool(no_such_argument=1)
    try:
        (reply,) = envs.reset([(0, SAMPLES[0])])  # built per episode: reported there
        assert reply.done and "no_such_argument" in (reply.error or "")
    finally:
        envs.shutdown()
    with pytest.raises(Exception, match="no_such_module"):
        EnvironmentPool("no_such_module:Env", env_mode="shared")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "backend"),
    [
        ("grpo_guess_number", "hf"),
        pytest.param("grpo_guess_number", "vllm", marks=pytest.mark.vllm),
        pytest.param("grpo_arithmetic_feedback", "vllm", marks=pytest.mark.vllm),
    ],
)
def test_a_short_multiturn_run(ray_cluster, tmp_path: Path, recipe: str, backend: str) -> None:
    from tandem.driver import run_grpo

    config = load_config(
        GrpoConfig,
        recipe,
        [
            "cluster.env_mode=shared",
            "cluster.runtime=ray",  # the environments are Ray actors either way
            f"generation.backend={backend}",
            "generation.kv_cache_bytes=33554432",
            f"logging.run_dir={tmp_path}",
            "logging.name=run",
            "logging.progress=false",
            "logging.tensorboard=false",
            "algorithm.num_steps=2",
            "algorithm.prompts_per_step=4",
            "algorithm.num_generations=4",
            "algorithm.eval_every=2",
            "data.num_eval_prompts=8",
        ],
    )
    records = run_grpo(config)
    last = records[-1]
    assert last["step"] == 2 and "eval/accuracy" in last and "eval/reward_mean" in last
    assert last["env/turns_mean"] >= 1 and last["env/errors"] == 0
    # the trainer scores the generator's multi-turn sequences: same weights, same logprobs
    assert last["gen/logprob_mismatch"] < 1e-3
