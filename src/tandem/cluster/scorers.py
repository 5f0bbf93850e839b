"""Models beside the policy: a reward model, an LLM judge and a distillation teacher, each a
worker of its own actor kind (``reward_model``, ``judge``, ``teacher`` in ``cluster.envs``).

``ModelScorers`` starts the ones a GRPO run configures where its runtime runs the policy's
workers (Ray actors with the same call timeouts and named ``WorkerError``s; or plain workers in
this process) and makes their calls:

    call                 worker                  returns
    score(samples, ...)  reward_model, judge     each rollout's reward: the weighted sum of the
                                                 rule's, the model's and the judge's (each logged)
    teacher_logprobs     teacher                 the teacher's logprob of every sampled token

Memory: a worker placed ``colocated`` on a GPU holds its weights on the host between its calls
(onload, compute, offload), so it never holds device memory while the trainer or the generators
work; ``split`` keeps them on its device. The worker classes know nothing of Ray.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.cluster.groups import Group, InlineGroup
from tandem.config.models import GenerationConfig, PolicyConfig
from tandem.config.scoring import RewardConfig

if TYPE_CHECKING:  # torch is imported where a worker is built: the checks run before it
    import torch

    from tandem.cluster.placement import ActorSlot
    from tandem.config.models import GrpoConfig
    from tandem.data.batch import TrainBatch
    from tandem.rewards.scorer import Scores

log = logging.getLogger(__name__)


def _move(model: torch.nn.Module, device: torch.device) -> None:
    import torch

    model.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()


class RewardModelWorker:
    """A reward model (``trainer.reward_model.RewardModel``) scoring text on its device.
    ``offload``: weights on the host between calls (colocated on a GPU)."""

    def __init__(self, path: str, batch_size: int, offload: bool, rank: int = 0):
        from tandem.tensors.devices import default_device
        from tandem.trainer.reward_model import RewardModel

        self.device = default_device(rank)
        self.offload = offload and self.device.type == "cuda"
        self.batch_size = batch_size
        self.model = RewardModel(Path(path), "cpu" if self.offload else self.device)

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        if not self.offload:
            return self.model.score(prompts, responses, self.batch_size)
        self.model.device = self.device
        _move(self.model.model, self.device)
        try:
            return self.model.score(prompts, responses, self.batch_size)
        finally:
            self.model.device = self.model.device.__class__("cpu")
            _move(self.model.model, self.model.device)


class TeacherWorker:
    """A frozen causal LM (the distillation teacher) giving per-token logprobs of the student's
    sequences, of its logits divided by ``temperature``; it shares the student's tokenizer
    (checked before it starts)."""

    def __init__(
        self,
        policy: PolicyConfig,
        path: str,
        offload: bool,
        temperature: float = 1.0,
        rank: int = 0,
    ):
        from tandem.trainer import PolicyTrainer

        config = policy.model_copy(
            update={"model_path": Path(path), "lora": None, "cpu_offload": False}
        )
        self.teacher = PolicyTrainer(config, rank=rank, world_size=1, trainable=False)
        self.teacher.model.temperature = temperature
        self.offload = offload and self.teacher.device.type == "cuda"
        if self.offload:
            self.teacher.offload()

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if not self.offload:
            return self.teacher.logprobs(batch)
        self.teacher.onload()
        try:
            return self.teacher.logprobs(batch)
        finally:
            self.teacher.offload()


def same_tokenizer(student: Path, teacher: Path) -> None:
    """A user's error naming both models unless their tokenizers map the same text to the same
    ids (vocabulary and special tokens): the teacher scores the student's token ids as they
    are."""
    from tandem.data.prompts import load_tokenizer

    mine, theirs = load_tokenizer(student), load_tokenizer(teacher)
    differences = [
        what
        for what, a, b in (
            ("vocabulary", mine.get_vocab(), theirs.get_vocab()),
            ("EOS token", mine.eos_token_id, theirs.eos_token_id),
            ("padding token", mine.pad_token_id, theirs.pad_token_id),
        )
        if a != b
    ]
    if differences:
        raise ValueError(
            f"algorithm.teacher={teacher} does not share the student's tokenizer "
            f"(policy.model_path={student}): their {', '.join(differences)} differ "
            f"({len(mine)} vs {len(theirs)} tokens); on-policy distillation scores the "
            "student's token ids with the teacher, so both need one tokenizer"
        )


def is_reward_model(path: Path) -> bool:
    """Whether the folder holds a sequence-classification model with one label (a trained score
    head), not a causal LM whose head would be drawn at random on loading."""
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures") or []
    labels = len(config.get("id2label") or {"0": ""})
    return any(a.endswith("ForSequenceClassification") for a in architectures) and labels == 1


def check_reward_model(path: Path, role: str) -> None:
    """A user's error (``ValueError`` naming ``role``, e.g. ``reward.model``) unless ``path`` is
    a reward model folder."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{role}={path}: not a Hugging Face model folder (no config.json)")
    if not is_reward_model(path):
        raise ValueError(
            f"{role}={path} has no sequence-classification head with one label (its "
            "architectures name no ...ForSequenceClassification): train one with `tandem rm` and "
            "give its export (the rm run's hf/ folder)"
        )


def check_scorers(config: GrpoConfig) -> None:
    """The models a run scores with, checked before anything starts (user's errors; torch is
    not imported, transformers only to compare a teacher's tokenizer)."""
    reward, teacher = config.reward, config.algorithm.teacher
    if config.environment is not None and (reward.has_models or teacher is not None):
        raise ValueError(
            "reward.model, reward.judge and algorithm.teacher score single responses: a run "
            "with an environment section takes its rewards from the environment"
        )
    if reward.model is not None:
        check_reward_model(reward.model, "reward.model")
    for role, path in (("reward.judge", reward.judge), ("algorithm.teacher", teacher)):
        if path is not None and not (path / "config.json").is_file():
            raise ValueError(f"{role}={path}: not a Hugging Face model folder (no config.json)")
    if teacher is not None:
        same_tokenizer(config.policy.model_path, teacher)


class ModelScorers:
    """The reward model, judge and teacher workers of a run (those configured), and their
    calls. ``groups``: kind -> ``Group`` of one worker."""

    def __init__(self, config: GrpoConfig, groups: dict[str, Group]):
        self.reward: RewardConfig = config.reward
        self.groups = groups
        self._judge_tokenizer: Any = None
        if "judge" in groups:
            from tandem.data.prompts import load_tokenizer

            assert self.reward.judge is not None
            self._judge_tokenizer = load_tokenizer(self.reward.judge)
        self._pattern = re.compile(self.reward.judge_pattern)

    @property
    def has_teacher(self) -> bool:
        return "teacher" in self.groups

    def close(self) -> None:
        for group in self.groups.values():
            group.shutdown()

    def score(self, samples: Sequence[tuple[str, str, str]], rule: Scores) -> Scores:
        """``rule`` (the rule reward's scores of ``samples``: prompt, response, answer) with
        the reward model's and the judge's added, each weighted: a rollout's reward is
        ``rule_weight * rule + model_weight * model + judge_weight * judge``."""
        from tandem.rewards.scorer import Scores

        cfg = self.reward
        parts = {"rule": (cfg.rule_weight, rule.rewards)}
        metrics = dict(rule.metrics)
        prompts = [s[0] for s in samples]
        responses = [s[1] for s in samples]
        if "reward_model" in self.groups:
            scores = self.groups["reward_model"].run("score", prompts, responses)[0]
            parts["model"] = (cfg.model_weight, scores)
        if "judge" in self.groups:
            verdicts, unparseable = self._judge(samples)
            parts["judge"] = (cfg.judge_weight, verdicts)
            metrics["reward/judge_unparseable_count"] = float(unparseable)
        total = [0.0] * len(samples)
        for name, (weight, values) in parts.items():
            metrics[f"reward/{name}_mean"] = sum(values) / max(len(values), 1)
            total = [t + weight * v for t, v in zip(total, values, strict=True)]
        return Scores(total, metrics)

    def _judge(self, samples: Sequence[tuple[str, str, str]]) -> tuple[list[float], int]:
        """The judge's parsed score of each sample (``judge_scale`` scaled) and how many
        verdicts had none (scored ``judge_unparseable``)."""
        from tandem.generation.base import SamplingParams

        cfg, tokenizer = self.reward, self._judge_tokenizer
        prompts = [
            tokenizer.encode(
                cfg.judge_template.format(prompt=p, response=r, answer=a),
                add_special_tokens=False,
            )
            for p, r, a in samples
        ]
        params = SamplingParams(temperature=0.0, max_tokens=cfg.judge_max_tokens, seed=0)
        rollouts = self.groups["judge"].run("generate", prompts, params)[0]
        scores, unparseable = [], 0
        for rollout in sorted(rollouts, key=lambda r: r.prompt_index):
            value = parse_verdict(rollout.response_text, self._pattern)
            if value is None:
                unparseable += 1
                log.debug("unparseable verdict %r", rollout.response_text)
                scores.append(cfg.judge_unparseable)
            else:
                scores.append(value / cfg.judge_scale)
        return scores, unparseable

    def teacher_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]``: the teacher's logprob of each token of ``batch`` (0 on the first)."""
        return self.groups["teacher"].run("logprobs", batch)[0]  # type: ignore[no-any-return]


def parse_verdict(text: str, pattern: re.Pattern[str]) -> float | None:
    """The first match of ``pattern`` in ``text`` as a float (its group 1 if it has one); None
    when there is none or it is not a number."""
    match = pattern.search(text)
    if match is None:
        return None
    try:
        return float(match.group(1) if pattern.groups else match.group(0))
    except (TypeError, ValueError):
        return None


def _workers(config: GrpoConfig) -> dict[str, tuple[type, dict[str, Any]]]:
    """kind -> (worker class, constructor arguments) of the models ``config`` scores with."""
    from tandem.cluster.actors import GeneratorWorker

    reward = config.reward
    offload = reward.placement == "colocated"
    workers: dict[str, tuple[type, dict[str, Any]]] = {}
    if reward.model is not None:
        workers["reward_model"] = (
            RewardModelWorker,
            dict(path=str(reward.model), batch_size=reward.batch_size, offload=offload),
        )
    if reward.judge is not None:
        generation = judge_generation(config.generation)
        workers["judge"] = (
            GeneratorWorker,
            dict(generation=generation, model_path=str(reward.judge)),
        )
    if config.algorithm.teacher is not None:
        workers["teacher"] = (
            TeacherWorker,
            dict(
                policy=config.policy,
                path=str(config.algorithm.teacher),
                offload=offload,
                temperature=config.algorithm.teacher_temperature,
            ),
        )
    return workers


def judge_generation(generation: GenerationConfig) -> GenerationConfig:
    """The judge's engine: the run's generation settings in float32 unless they name a dtype
    (it receives no refits)."""
    dtype = "float32" if generation.dtype == "auto" else generation.dtype
    return generation.model_copy(
        update={"dtype": dtype, "precision": "bf16", "max_lora_rank": None}
    )


def scorer_kinds(config: GrpoConfig) -> list[str]:
    """The kinds of the models ``config`` scores with, in the order they start (before torch:
    the run's placement reserves a slot for each)."""
    paths = {
        "reward_model": config.reward.model,
        "judge": config.reward.judge,
        "teacher": config.algorithm.teacher,
    }
    return [kind for kind, path in paths.items() if path is not None]


@contextmanager
def model_scorers(
    config: GrpoConfig, slots: Sequence[ActorSlot] = ()
) -> Iterator[ModelScorers | None]:
    """The run's ``ModelScorers`` (None when it scores with no model), started where its
    ``cluster.runtime`` (resolved) runs the policy's workers, shut down when the block ends.
    ``slots``: the places the run's placement reserved for them (Ray), one per kind."""
    workers = _workers(config)
    if not workers:
        yield None
        return
    cluster = config.cluster
    groups: dict[str, Group] = {}
    places = dict(zip(scorer_kinds(config), slots, strict=False))
    try:
        for kind, (cls, kwargs) in workers.items():
            if cluster.runtime == "ray":
                groups[kind] = _actor_group(config, kind, cls, kwargs, places.get(kind))
            else:  # this process, as the policy's workers
                groups[kind] = InlineGroup([cls(**kwargs)], kind)
        scorers = ModelScorers(config, groups)
    except BaseException:
        for group in groups.values():
            group.shutdown()
        raise
    try:
        yield scorers
    finally:
        scorers.close()


def _actor_group(
    config: GrpoConfig, kind: str, cls: type, kwargs: dict[str, Any], slot: ActorSlot | None
) -> Group:
    """One Ray actor of ``kind`` in its environment (in ``slot`` of the run's placement where
    it has one: a share of a GPU), with the run's process settings and the reward section's
    call timeout."""
    from tandem.cluster.launch import ProcessSettings
    from tandem.cluster.placement import actor_threads
    from tandem.cluster.ray_cluster import init_ray
    from tandem.cluster.worker_group import WorkerGroup

    cluster = config.cluster
    init_ray(cluster.address)  # started already by the policy's workers, unless in a tool
    settings = ProcessSettings(actor_threads(cluster), keep_freed_host_memory=True)
    group = WorkerGroup(
        cls,
        1,
        kind=kind,
        kwargs=kwargs,
        env_vars=settings.as_env(),
        env_mode=cluster.env_mode,
        num_cpus=cluster.cpus_per_actor,
        bundles=None if slot is None else [slot],
        call_timeout_s=cluster.call_timeout_s,  # its start (the model's load)
    )
    if kind != "teacher":  # a scoring call: the reward section's bound
        group.call_timeout_s, group.timeout_setting = config.reward.timeout_s, "reward.timeout_s"
    return group
