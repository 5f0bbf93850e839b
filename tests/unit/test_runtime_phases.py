"""The runtime's memory phases, on CPU, with the real workers in this process (``LocalGroup``,
and the in-process runtime's ``InlineGroup`` with its refit by copy).

On the CPU nothing physically moves, but ``PolicyTrainer`` refuses to compute while flagged
offloaded, and the workers record what the runtime asked of them: the GRPO step, evaluation and
checkpoints must run in any order without meeting an offloaded trainer, the reference follows the
same phases, releases come before acquisitions, and a generator whose sleep dropped its weights is
refitted before it generates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.algorithms.grpo import evaluate, grpo_step
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.cluster.groups import InlineGroup, LocalGroup, WorkerError
from tandem.cluster.refit import CopyRefit, TransportRefit
from tandem.cluster.runtime import Runtime
from tandem.config import GrpoConfig, load_config
from tandem.data.prompts import make_prompt_source
from tandem.rewards import load_reward


class RecordingTrainer(TrainerWorker):
    """The real trainer worker, logging the phase calls it gets."""

    def __init__(self, log: list[str], **kwargs: Any):
        super().__init__(**kwargs)
        self.log = log

    def set_residency(
        self, policy: bool | None = None, reference: bool | None = None
    ) -> dict[str, float]:
        self.log.append(f"trainer policy={policy} reference={reference}")
        return super().set_residency(policy, reference)

    def release_cached_memory(self) -> None:
        self.log.append("trainer release")
        super().release_cached_memory()


class RecordingGenerator(GeneratorWorker):
    """The real (transformers) generator worker; its sleep can drop its weights, as vLLM's
    level-2 sleep does: they are zeroed, so a generate before a refit would be visibly wrong."""

    def __init__(self, log: list[str], drop_weights: bool, **kwargs: Any):
        super().__init__(**kwargs)
        self.log, self.drop_weights = log, drop_weights

    def sleep(self) -> None:
        self.log.append("generator sleep")
        if self.drop_weights:
            with torch.no_grad():
                for param in self.generator.model.parameters():  # type: ignore[attr-defined]
                    param.zero_()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.log.append(f"generator wake {tags}")

    def generate_timed(self, prompt_token_ids: list[list[int]], params: Any) -> Any:
        self.log.append("generate")
        return super().generate_timed(prompt_token_ids, params)


def _config(tmp_path: Path, *overrides: str) -> GrpoConfig:
    return load_config(
        GrpoConfig,
        "grpo_arithmetic",
        [
            "generation.backend=hf",
            "algorithm.prompts_per_step=4",
            "algorithm.num_generations=4",
            "algorithm.kl_coef=0.05",
            "policy.micro_batch_size=8",
            f"logging.run_dir={tmp_path}",
            *overrides,
        ],
    )


def _runtime(config: GrpoConfig, log: list[str], drop_weights: bool, refit: str) -> Runtime:
    trainer = RecordingTrainer(
        log,
        policy=config.policy,
        refit=config.refit.model_copy(update={"transport": "colocated"}),
        generation=config.generation,
        with_reference=True,
    )
    generator = RecordingGenerator(
        log, drop_weights, generation=config.generation, model_path=str(DEFAULT_MODEL_DIR)
    )
    # a transport refit needs groups that work at once; a copy takes any in this process
    group, strategy = (
        (LocalGroup, TransportRefit()) if refit == "transport" else (InlineGroup, CopyRefit())
    )
    return Runtime(
        group([trainer], "trainer"),
        group([generator], "generator"),
        refit=strategy,
        memory_phases=True,
        discards_weights=drop_weights,
        with_reference=True,
    )


STEP_PHASES = [
    # generation: the policy (the reference is still on the host) leaves, the KV cache wakes
    "trainer policy=False reference=None",
    "generator wake ['kv_cache']",
    "generate",
    # reference logprobs with the engine asleep and only the reference on the device
    "generator sleep",
    "trainer policy=None reference=True",
    # training: the reference leaves before the policy comes back
    "trainer policy=None reference=False",
    "trainer policy=True reference=None",
    # refit: the resident trainer hands back its step's blocks, then the engine's weights
    # wake, not yet its KV cache
    "trainer release",
    "generator wake ['weights']",
]


@pytest.mark.parametrize("refit", ["transport", "copy"])
@pytest.mark.parametrize("drop_weights", [False, True], ids=["sleep-keeps", "sleep-drops"])
def test_grpo_steps_evaluation_and_checkpoints_meet_no_offloaded_trainer(
    tmp_path: Path, drop_weights: bool, refit: str
) -> None:
    config = _config(tmp_path)
    source = make_prompt_source(
        config.data, config.policy.model_path, load_reward(config.data.reward), seed=0
    )
    log: list[str] = []
    announced: list[str] = []  # what the progress bar shows (Runtime.on_phase)
    with _runtime(config, log, drop_weights, refit) as runtime:
        runtime.on_phase = announced.append
        trainer = runtime.trainers.workers[0]  # type: ignore[attr-defined]
        for step in (1, 2, 3):
            metrics = grpo_step(
                runtime, config, source.train_prompts(step, 4), step, source
            ).metrics
            # the generator sampled with the trainer's weights: each refit landed
            assert metrics["gen/logprob_mismatch"] < 1e-4, step
        assert log[-len(STEP_PHASES) :] == STEP_PHASES
        assert announced == ["generate", "reference logprobs", "train", "refit"] * 3

        evaluate(runtime, source, 4, config.generation.sampling)
        assert not trainer.policy.resident and not trainer.reference.resident
        runtime.save_checkpoint(str(tmp_path / "ckpt"))  # brings the policy back
        assert announced[-2:] == ["generate", "checkpoint"]  # the evaluation, the checkpoint
        assert trainer.policy.resident and log[-2:] == [
            "generator sleep",
            "trainer policy=True reference=None",
        ]
        # out of the loop's order: generation after a sleep, logprobs right after generation
        prompt = [source.encode("12+7=")]
        first = runtime.generate(prompt, _greedy())
        logprobs = runtime.policy_logprobs(_batch(source, first[0]))
        again = runtime.generate(prompt, _greedy())

    # a sleep that dropped the weights was followed by a refit before generating: the greedy
    # answer and its logprobs are the trained policy's, not those of zeroed weights
    assert again[0].response_token_ids == first[0].response_token_ids
    assert again[0].response_logprobs == pytest.approx(first[0].response_logprobs, abs=1e-5)
    response = logprobs[0, -len(first[0].response_token_ids) :]
    assert response.tolist() == pytest.approx(first[0].response_logprobs, abs=1e-4)


def _greedy() -> Any:
    from tandem.generation.base import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=4)


def _batch(source: Any, rollout: Any) -> Any:
    from tandem.algorithms.rollouts import rollouts_to_batch

    return rollouts_to_batch([rollout], source.pad_token_id)


def test_an_offloaded_trainer_refuses_to_compute(tmp_path: Path) -> None:
    config = _config(tmp_path)
    refit = config.refit.model_copy(update={"transport": "colocated"})
    worker = TrainerWorker(config.policy, refit, config.generation)
    source = make_prompt_source(config.data, DEFAULT_MODEL_DIR, load_reward("exact_match"), 0)
    batch = _batch(source, _rollout(source))
    worker.set_residency(policy=False)
    with pytest.raises(RuntimeError, match=r"logprobs\(\) called while offloaded"):
        worker.logprobs(batch)
    group = LocalGroup([worker], "trainer")
    offloaded = r"failed in prepare_refit\(\): RuntimeError: PolicyTrainer.iter_weights\(\) called"
    with pytest.raises(WorkerError, match=offloaded):
        group.run("prepare_refit")
    group.run("set_residency", policy=True)
    assert group.run("logprobs", batch)[0].shape == batch.input_ids.shape


def _rollout(source: Any) -> Any:
    from tandem.generation.base import Rollout

    return Rollout(0, source.encode("1+1="), [5, 6], "", [-1.0, -1.0])


@pytest.mark.parametrize("parallel", [True, False])
def test_start_groups_overlaps_the_kinds_and_cleans_up_after_a_failure(parallel: bool) -> None:
    """Both kinds start at once (a barrier that needs both), or one after the other; when one
    fails, the one that started is shut down and the failure is raised."""
    from threading import Barrier

    from tandem.cluster.groups import LocalGroup
    from tandem.cluster.launch import start_groups

    barrier = Barrier(2, timeout=5)
    shut: list[str] = []
    events: list[str] = []

    class Tracked(LocalGroup):
        def shutdown(self) -> None:
            shut.append(self.kind)
            super().shutdown()

    def make(kind: str, fail: bool = False) -> LocalGroup:
        events.append(f"start {kind}")
        if parallel:
            barrier.wait()  # returns only when the other kind is starting too
        if fail:
            raise ValueError(f"{kind} failed")
        events.append(f"end {kind}")
        return Tracked([object()], kind)

    makers = {"trainer": lambda: make("trainer"), "gen": lambda: make("gen")}
    started = start_groups(makers, parallel)
    assert sorted(started) == ["gen", "trainer"] and shut == []
    if not parallel:
        assert events == ["start trainer", "end trainer", "start gen", "end gen"]
    barrier.reset()
    makers["gen"] = lambda: make("gen", fail=True)
    with pytest.raises(ValueError, match="gen failed"):
        start_groups(makers, parallel)
    assert shut == ["trainer"]


@pytest.mark.parametrize("engine_shutdown", [True, False])
def test_close_shuts_the_engines_down_first_only_where_asked(engine_shutdown: bool) -> None:
    """``close()`` kills the groups; the engines' own shutdown comes first where asked (an engine
    with processes of its own, one on a GPU), not where the kill ends it (vLLM's shutdown of an
    in-process engine spends ~1 s collecting garbage)."""
    from tandem.cluster.groups import LocalGroup

    events: list[str] = []

    class Engine:
        def shutdown(self) -> None:
            events.append("engine shutdown")

    class Tracked(LocalGroup):
        def shutdown(self) -> None:
            events.append(f"kill {self.kind}")
            super().shutdown()

    runtime = Runtime(
        Tracked([object()], "trainer"),
        Tracked([Engine()], "generator"),
        engine_shutdown=engine_shutdown,
    )
    runtime.close()
    expected = ["engine shutdown"] if engine_shutdown else []
    assert events == [*expected, "kill generator", "kill trainer"]
