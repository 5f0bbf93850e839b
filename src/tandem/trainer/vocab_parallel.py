"""Token logprobs and entropies from logits split over the vocabulary (Megatron's output layer
is column-parallel: each tensor-parallel rank holds ``V / t`` columns of every token's logits).

The reductions over ranks are passed in, so the arithmetic is plain torch and runs (and is
tested) on one process: ``reduce_sum`` must be autograd-aware with an identity backward
(Megatron's ``reduce_from_tensor_parallel_region``: every rank computes the same loss from the
reduced values, so each rank's partial sum gets the reduced value's gradient unchanged);
``reduce_max`` works on values that need no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]

MASKED_LOGIT = -1e30
"""What padded vocabulary columns become: exp() of it is 0 and 0 times it is 0 (an infinity
would make the entropy's sum NaN)."""


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    with_entropy: bool = False,
    reduce_sum: Reduce = _identity,
    reduce_max: Reduce = _identity,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and (with ``with_entropy``) the entropy of every position of
    ``logits`` ``[..., V_local]`` (this rank's columns ``vocab_start ..``), in float32.
    Columns at or past ``vocab_size`` (the padded vocabulary) are left out of the softmax."""
    logits = logits.float()
    local = logits.shape[-1]
    if vocab_size is not None and vocab_start + local > vocab_size:
        columns = torch.arange(vocab_start, vocab_start + local, device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, MASKED_LOGIT)
    top = reduce_max(logits.detach().amax(dim=-1))
    shifted = logits - top.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_sum(exp.sum(dim=-1))
    index = targets - vocab_start
    here = (index >= 0) & (index < local)
    picked = shifted.gather(-1, index.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_sum(torch.where(here, picked, torch.zeros_like(picked)))
    log_norm = sum_exp.log()
    logprobs = picked - log_norm
    if not with_entropy:
        return logprobs, None
    # H = log Z - E_p[shifted logit], Z = sum exp(shifted)
    expected = reduce_sum((exp * shifted).sum(dim=-1)) / sum_exp
    return logprobs, log_norm - expected
