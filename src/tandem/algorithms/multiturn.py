"""Multi-turn episodes: generator turns and environment turns, alternating, in one token sequence.

An episode starts from the environment's first observation and alternates a model turn (one
``generate`` call for every live episode at once) and an environment turn (every live episode's
``step`` at once, in the environment actors) until the environment says done, the turn budget
(``max_turns`` model turns) or the token budget (``max_tokens`` for the whole sequence) runs out,
or the environment fails. The result is one sequence per episode: its tokens, a loss mask that is
1 on the generated tokens only, and the generator's logprobs of those tokens. Every model turn is
generated from the exact token ids of the episode so far (never re-tokenised text), so the
trainer's logprobs of the sequence match the generator's on every generated token, and GRPO's
loss and the logprob-mismatch check are as exact as in single-turn rollouts. ``episode_rollout``
turns an episode into a ``Rollout`` whose ``response_mask`` marks the environment's tokens, so
the GRPO step trains on episodes as on single-turn rollouts.

Torch and dataclasses only: generation and the environments come in as callables / a protocol.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.data.turns import TurnEncoder
from tandem.environments.base import EnvReply
from tandem.generation.base import Rollout, SamplingParams

GenerateFn = Callable[[list[list[int]], SamplingParams], list[Rollout]]

_TURN_SEED_STRIDE = 100_003
"""Seed offset between two turns of one ``run_episodes`` call (steps are 1_000_003 apart)."""


class EnvironmentRunner(Protocol):
    """Where the environments live (``tandem.cluster.env_pool.EnvironmentPool``, or in-process)."""

    def reset(self, episodes: list[tuple[int, dict[str, str]]]) -> list[EnvReply]: ...

    def step(self, episodes: list[tuple[int, str]]) -> list[EnvReply]: ...

    def close(self, episodes: list[int]) -> None: ...


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    """Model turns per episode."""
    max_tokens: int
    """Tokens per episode sequence (prompt, every turn of both sides)."""


@dataclass
class Episode:
    """One episode's sequence and outcome."""

    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on generated tokens, 0 on the prompt and the environment's turns."""
    logprobs: list[float] = field(default_factory=list)
    """The generator's logprob of each token (0 where ``loss_mask`` is 0)."""
    reward: float = 0.0
    num_turns: int = 0
    done: bool = False
    end: str = ""
    """Why it ended: ``env`` (the environment said done), ``turns``, ``tokens``, ``error``."""
    error: str | None = None

    def extend(
        self, tokens: Sequence[int], generated: bool, logprobs: Sequence[float] = ()
    ) -> None:
        self.token_ids.extend(tokens)
        self.loss_mask.extend([int(generated)] * len(tokens))
        self.logprobs.extend(logprobs if generated else [0.0] * len(tokens))

    def finish(self, end: str, error: str | None = None) -> None:
        self.done, self.end, self.error = True, end, error


def run_episodes(
    samples: Sequence[dict[str, str]],
    num_episodes: int,
    generate: GenerateFn,
    envs: EnvironmentRunner,
    encoder: TurnEncoder,
    params: SamplingParams,
    limits: EpisodeLimits,
) -> list[Episode]:
    """``num_episodes`` episodes per sample, grouped: episodes ``[i*n, (i+1)*n)`` are sample i's.
    ``params.max_tokens`` bounds one model turn; ``params.n`` is ignored."""
    episodes = [Episode(i // num_episodes) for i in range(len(samples) * num_episodes)]
    replies = envs.reset([(i, samples[e.sample_index]) for i, e in enumerate(episodes)])
    for episode, reply in zip(episodes, replies, strict=True):
        if reply.error is not None:
            episode.finish("error", reply.error)
        else:
            episode.extend(encoder.first(reply.observation), generated=False)
            if len(episode.token_ids) >= limits.max_tokens:
                episode.finish("tokens")
    for turn in range(limits.max_turns):
        live = [i for i, e in enumerate(episodes) if not e.done]
        if not live:
            break
        seed = None if params.seed is None else params.seed + turn * _TURN_SEED_STRIDE
        rollouts = generate(
            [episodes[i].token_ids for i in live], dataclasses.replace(params, n=1, seed=seed)
        )
        for i, rollout in zip(live, rollouts, strict=True):
            _take_model_turn(episodes[i], rollout, limits.max_tokens)
        replies = envs.step([(i, r.response_text) for i, r in zip(live, rollouts, strict=True)])
        for i, reply in zip(live, replies, strict=True):
            _take_env_turn(
                episodes[i], reply, encoder, limits, last_turn=turn + 1 == limits.max_turns
            )
    envs.close([i for i, e in enumerate(episodes) if e.end != "env"])
    return episodes


def _take_model_turn(episode: Episode, rollout: Rollout, max_tokens: int) -> None:
    room = max_tokens - len(episode.token_ids)
    tokens, logprobs = rollout.response_token_ids[:room], rollout.response_logprobs[:room]
    episode.extend(tokens, generated=True, logprobs=logprobs)
    episode.num_turns += 1
    if len(rollout.response_token_ids) > room or len(episode.token_ids) >= max_tokens:
        episode.finish("tokens")  # the environment still scores the (possibly cut) turn


def _take_env_turn(
    episode: Episode, reply: EnvReply, encoder: TurnEncoder, limits: EpisodeLimits, last_turn: bool
) -> None:
    if reply.error is not None:
        episode.finish("error", reply.error)
        return
    episode.reward += reply.reward
    if reply.done:
        episode.finish("env")
        return
    if episode.done:  # out of tokens during the model's turn
        return
    if last_turn:
        episode.finish("turns")
        return
    last = episode.token_ids[-1] if episode.token_ids else None
    observation = encoder.next(reply.observation, last)
    if len(episode.token_ids) + len(observation) >= limits.max_tokens:
        episode.finish("tokens")  # no room for the observation and a model turn after it
        return
    episode.extend(observation, generated=False)


def episode_rollout(episode: Episode, pad_token_id: int) -> Rollout:
    """The episode as a ``Rollout``: the prompt is what precedes the first generated token, the
    response everything after it, with ``response_mask`` 0 on the environment's turns. An
    episode with no tokens (its reset failed) becomes one untrained padding token."""
    tokens = episode.token_ids or [pad_token_id]
    mask = episode.loss_mask or [0]
    first = mask.index(1) if 1 in mask else len(tokens)
    return Rollout(
        prompt_index=episode.sample_index,
        prompt_token_ids=tokens[:first],
        response_token_ids=tokens[first:],
        response_text="",
        response_logprobs=(episode.logprobs or [0.0])[first:],
        finish_reason="stop" if episode.end == "env" else "length",
        response_mask=mask[first:],
    )


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Turns, lengths, how episodes ended and how many environment errors (counts per step)."""
    count = len(episodes)
    metrics = {
        "env/turns_mean": sum(e.num_turns for e in episodes) / count,
        "env/episode_tokens_mean": sum(len(e.token_ids) for e in episodes) / count,
        "env/errors": float(sum(e.error is not None for e in episodes)),
    }
    for end in ("env", "turns", "tokens", "error"):
        metrics[f"env/end_{end}_frac"] = sum(e.end == end for e in episodes) / count
    return metrics
