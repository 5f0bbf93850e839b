"""From generator rollouts to scored, padded training batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tandem.data.batch import TrainBatch
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
    generated ones of a multi-turn episode: ``Rollout.response_mask``)."""
    lengths = [len(r.prompt_token_ids) + len(r.response_token_ids) for r in rollouts]
    size, width = len(rollouts), max(lengths)
    input_ids = torch.full((size, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((size, width), dtype=torch.long)
    loss_mask = torch.zeros((size, width), dtype=torch.float32)
    generator_logprobs = torch.zeros((size, width), dtype=torch.float32)
    for row, rollout in enumerate(rollouts):
        prompt, response = rollout.prompt_token_ids, rollout.response_token_ids
        start, end = len(prompt), len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention_mask[row, :end] = 1
        mask = rollout.response_mask
        loss_mask[row, start:end] = 1.0 if mask is None else torch.tensor(mask, dtype=torch.float32)
        generator_logprobs[row, start:end] = torch.tensor(
            rollout.response_logprobs, dtype=torch.float32
        )
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        generator_logprobs=generator_logprobs,
    )
