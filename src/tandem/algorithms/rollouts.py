"""From generator rollouts to scored, padded training batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tandem.data.batch import TrainBatch
from tandem.data.images import RowImages
from tandem.generation.base import Rollout
from tandem.rewards.scorer import RewardScorer, Scores

__all__ = ["Scores", "rollouts_to_batch", "score_rollouts"]


def score_rollouts(
    reward: RewardScorer | Callable[[str, str, str], float],
    prompts: Sequence[dict[str, str]],
    rollouts: Sequence[Rollout],
    decode: Callable[[list[int]], str],
) -> Scores:
    """Reward of every rollout against its prompt's reference answer, with the scorer's metrics.

    A plain function is scored in this process. A reward that raises, returns a non-finite
    number or hangs is reported with the sample (``RewardScorer``), never swallowed.
    """
    scorer = reward if isinstance(reward, RewardScorer) else RewardScorer("<function>", fn=reward)
    samples = []
    for rollout in rollouts:
        item = prompts[rollout.prompt_index]
        response = rollout.response_text or decode(rollout.response_token_ids)
        samples.append((item["prompt"], response, item["answer"]))
    return scorer.score(samples)


def rollouts_to_batch(rollouts: Sequence[Rollout], pad_token_id: int) -> TrainBatch:
    """Right-padded prompt+response batch; the loss covers the response tokens only (the
    generated ones of a multi-turn episode: ``Rollout.response_mask``). Image prompts
    (``data.images.ImagePrompt``) bring their images."""
    lengths = [len(r.prompt_token_ids) + len(r.response_token_ids) for r in rollouts]
    width = max(lengths)
    # rows as Python lists, one tensor each: a tensor per row and field cost 5x as much
    # (docs/benchmarks/2026-12-05-cpu-e2e-amd.md)
    ids, trained, logprobs = [], [], []
    for rollout, end in zip(rollouts, lengths, strict=True):
        prompt, response = rollout.prompt_token_ids, rollout.response_token_ids
        start, tail = len(prompt), width - end
        mask = [1.0] * len(response) if rollout.response_mask is None else rollout.response_mask
        ids.append([*prompt, *response] + [pad_token_id] * tail)
        trained.append([0.0] * start + [float(m) for m in mask] + [0.0] * tail)
        logprobs.append([0.0] * start + list(rollout.response_logprobs) + [0.0] * tail)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    loss_mask = torch.tensor(trained, dtype=torch.float32)
    generator_logprobs = torch.tensor(logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        generator_logprobs=generator_logprobs,
        images=RowImages.of([r.prompt_token_ids for r in rollouts]),
    )
