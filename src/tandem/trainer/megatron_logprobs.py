"""Token logprobs from the last stage of Megatron's GPT model.

At tensor-parallel size 1 the output layer runs inside GPTModel's ``output_processor`` hook,
chunk by chunk of tokens with the log-softmax (``logprobs.ChunkedTokenLogprobs``, as the FSDP2
trainer): ``[tokens, vocab]`` logits never exist, and the padded vocabulary's rows are left
out. Over several tensor-parallel ranks the model returns each rank's vocabulary columns of the
logits and ``vocab_parallel`` reduces over the ranks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tandem.trainer.logprobs import token_logprobs as chunked_token_logprobs
from tandem.trainer.vocab_parallel import token_logprobs as split_token_logprobs


def head_kwargs(tp_size: int, vocab_size: int, chunk_size: int, with_entropy: bool) -> dict:
    """The GPT model's forward keywords: the chunked head at tensor-parallel size 1, else
    none (the model returns its split logits)."""
    if tp_size > 1:
        return {}
    head = partial(chunked_head, vocab_size=vocab_size, chunk_size=chunk_size)
    return {"output_processor": head, "output_processor_context": with_entropy}


def chunked_head(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    input_ids: torch.Tensor,
    context: bool,
    vocab_size: int,
    chunk_size: int,
    **_: Any,
) -> torch.Tensor:
    """GPTModel's ``output_processor``: the final hidden states ``[s, b, h]`` through the output
    layer's first ``vocab_size`` rows (or the tied embedding, ``output_weight``) and the
    log-softmax. Returns ``[2, b, s - 1]``: each next token's logprob and the entropy (zeros
    unless ``context``, the with-entropy flag)."""
    weight = output_layer.weight if output_weight is None else output_weight
    hidden = hidden_states.transpose(0, 1)[:, :-1]
    rows, width = hidden.shape[0], hidden.shape[1]
    picked, entropy = chunked_token_logprobs(
        hidden.reshape(rows * width, -1),
        weight[:vocab_size],
        input_ids[:, 1:].reshape(-1),
        chunk_size,
        context,
    )
    return torch.stack([picked, entropy]).view(2, rows, width)


def aligned(
    output: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    with_entropy: bool,
    tp_group: Any,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned ``[b, T]`` logprobs and entropies (entry t: token t given the tokens
    before it; entry 0 and padding 0), as ``LogprobModel`` lays them out, from the last stage's
    ``output``: ``chunked_head``'s ``[2, b, T - 1]`` on one tensor-parallel rank, else this
    rank's vocabulary columns of the logits ``[b, T, V/t]`` (``tp_group``: the tensor-parallel
    group, None for one rank)."""
    entropy: torch.Tensor | None
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        picked, entropy = output[0], output[1]
    else:
        picked, entropy = _split_vocab(output, input_ids, with_entropy, tp_group, vocab_size)
    zeros = torch.zeros(input_ids.shape[0], 1, device=output.device)
    mask = attention_mask.to(torch.float32)
    logprobs = torch.cat([zeros, picked], dim=1) * mask
    if not with_entropy or entropy is None:
        return logprobs, torch.zeros_like(logprobs)
    return logprobs, torch.cat([zeros, entropy], dim=1) * mask


def _split_vocab(
    logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool, tp_group: Any, vocab: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def reduce_max(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp_group)
        return x

    return split_token_logprobs(
        logits[:, :-1],
        input_ids[:, 1:],
        vocab_start=dist.get_rank(tp_group) * logits.shape[-1],
        vocab_size=vocab,
        with_entropy=with_entropy,
        reduce_sum=partial(reduce_from_tensor_model_parallel_region, group=tp_group),
        reduce_max=reduce_max,
    )
