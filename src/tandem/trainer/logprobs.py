"""Token logprobs from a causal LM without materialising full-vocabulary logits for the whole
batch: the LM head, the log-softmax and their backward run over chunks of tokens
(``ChunkedTokenLogprobs``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.data.images import RowImages, vision_inputs

MAX_CHUNK_LOGITS = 1 << 26
"""Most logits (tokens x vocabulary) one chunk computes: 256 MiB in fp32, so a 151,936-token
vocabulary takes chunks of at most 441 tokens whatever ``chunk_size`` says."""


def chunk_rows(chunk_size: int, vocab_size: int) -> int:
    """Tokens per chunk: ``chunk_size``, capped by ``MAX_CHUNK_LOGITS``."""
    return max(1, min(chunk_size, MAX_CHUNK_LOGITS // vocab_size))


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``log softmax(hidden @ weight.T)[i, targets[i]]`` and the entropy of each row, chunk by
    chunk of tokens, with a backward that recomputes one chunk's logits at a time.

    Forward keeps only its inputs. Each chunk's logits stay in the compute dtype (the head's
    matmul on tensor cores for bf16, as vLLM): the (log-)softmax reads them once and
    accumulates in fp32, and backward writes the logits' gradient (``grad_logprob * (onehot -
    p)``, plus the entropy's ``-grad_entropy * p * (log p + H)``) straight into the compute
    dtype for the head's two matmuls. No fp32 copy of the logits is made first: at a
    151,936-token vocabulary such elementwise passes over the chunks' logits took about a
    quarter of a 1.5B train step on an H100 (docs/benchmarks/2026-12-07-h100-cells.md). Peak
    extra memory: one chunk's fp32 probabilities, its logits and their gradient,
    whatever the number of tokens."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        rows: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = hidden.shape[0]
        picked = hidden.new_zeros(count, dtype=torch.float32)
        entropy = torch.zeros_like(picked)
        for start in range(0, count, rows):
            part = slice(start, start + rows)
            logp = torch.log_softmax(F.linear(hidden[part], weight), -1, dtype=torch.float32)
            picked[part] = logp.gather(-1, targets[part, None])[:, 0]
            if with_entropy:
                entropy[part] = -logp.exp().mul_(logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.rows = rows
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_picked: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            h = hidden[part]
            grad = _logits_grad(
                F.linear(h, weight),
                targets[part],
                _part(grad_picked, part),
                _part(grad_entropy, part),
            )
            if grad_hidden is not None:
                grad_hidden[part] = grad @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, h)
        return grad_hidden, grad_weight, None, None, None


def _part(grad: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if grad is None else grad[part]


def _logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grad_picked: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient on a chunk's logits, ``g_lp * (onehot - p) - g_H * p * (log p + H)``,
    computed in fp32 and rounded once into the logits' dtype."""
    scale = (
        torch.zeros_like(logits[:, 0], dtype=torch.float32) if grad_picked is None else grad_picked
    )
    if grad_entropy is None:
        probs = torch.softmax(logits, -1, dtype=torch.float32)
        factor = scale.neg()[:, None]  # g_lp * (onehot - p) off the target: p * -g_lp
    else:
        logp = torch.log_softmax(logits, -1, dtype=torch.float32)
        probs = logp.exp()
        entropy = -(probs * logp).sum(-1, keepdim=True)
        factor = logp.add_(entropy).mul_(grad_entropy[:, None].neg()).sub_(scale[:, None])
    grad = torch.mul(probs, factor, out=torch.empty_like(logits))
    # the target's entry, g_lp + p * factor, from the fp32 figures: rounded once like the rest
    column = targets[:, None]
    on_target = (
        scale + (probs.gather(-1, column) * factor.expand_as(probs).gather(-1, column))[:, 0]
    )
    grad.scatter_(-1, column, on_target[:, None].to(grad.dtype))
    return grad


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N]`` fp32 logprobs of ``targets`` under ``hidden @ weight.T`` and the entropies
    (zeros without ``with_entropy``), through ``ChunkedTokenLogprobs``."""
    rows = chunk_rows(chunk_size, weight.shape[0])
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, rows, with_entropy)  # type: ignore[no-any-return]


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row is real tokens then padding (no padding before a real token).

    Under a causal mask a real token of such a row attends only to real tokens before it, and
    its positions are 0, 1, ... as without padding, so the model's outputs on real tokens are
    those of the unmasked causal call. Passing the padding mask makes attention build a
    ``[b, 1, T, T]`` mask and leave its causal kernel, a fifth of the long CPU workload's train
    step (``bench/e2e_cpu.py``; figures: docs/benchmarks/2026-12-04-cpu-e2e.md)."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


class LogprobModel(nn.Module):
    """Wraps a Hugging Face causal LM; ``forward`` returns token-aligned logprobs ``[B, T]``
    (entry t = log p(token t | tokens < t), entry 0 = 0) and the entropy of each prediction.

    Being the FSDP root, it gathers the embeddings, final norm and LM head for its forward.
    The LM head and the log-softmax run chunk by chunk of tokens (``ChunkedTokenLogprobs``):
    forward keeps only the hidden states and one log-normaliser per token, backward
    recomputes one chunk's logits at a time (one extra LM-head matmul per chunk), so
    ``[tokens, vocab]`` logits never exist.
    """

    def __init__(self, lm: nn.Module, chunk_size: int):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        self.temperature = 1.0
        """The logits are divided by it (a distillation teacher's sharpening)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        with_entropy: bool = False,
        position_ids: torch.Tensor | None = None,
        sources: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        images: RowImages | None = None,
        causal: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A right-padded ``attention_mask`` only zeroes the padding's outputs: the model runs
        causal without it (``right_padded``; ``causal``: the caller's answer, found on the host,
        where the check of a device mask would wait for the device).

        Packed layouts (``tandem.data.packing``) pass their ``position_ids``, their 4D
        ``attention_mask`` or None (block-diagonal from positions that restart), and the
        pairs to score: ``targets[i]`` as predicted by the hidden state at flat position
        ``sources[i]`` of ``input_ids``; the results are then ``[n]``, one per pair.

        A vision-language model (Qwen2-VL family) runs its whole body: the vision tower on
        ``images`` (the rows' images in row order), their features in place of the image
        tokens, multimodal positions (``data.images.vision_inputs``); ``images``: the rows'."""
        lm: Any = self.lm  # a Hugging Face PreTrainedModel
        if sources is None:
            if attention_mask is not None and causal is None:
                causal = right_padded(attention_mask)
            body_mask = None if attention_mask is None or causal else attention_mask
        else:
            body_mask = attention_mask
        if hasattr(lm.model, "visual"):
            assert position_ids is None, "vision-language batches are not packed"
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            embeds, positions = vision_inputs(lm, input_ids, mask, images)
            # use_cache: the trainer turns off the top config's; the text config has its own
            hidden = lm.model(
                inputs_embeds=embeds,
                attention_mask=body_mask,
                position_ids=positions,
                use_cache=False,
            ).last_hidden_state
        else:
            hidden = lm.get_decoder()(
                input_ids=input_ids, attention_mask=body_mask, position_ids=position_ids
            ).last_hidden_state
        if sources is None:
            flat_hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
            flat_targets = input_ids[:, 1:].reshape(-1)
        else:
            assert targets is not None, "sources come with their targets"
            flat_hidden = hidden.reshape(-1, hidden.shape[-1])[sources]
            flat_targets = targets
        head_weight = lm.get_output_embeddings().weight
        if self.temperature != 1.0:  # the head is linear with no bias: logits / t
            flat_hidden = flat_hidden / self.temperature
        picked, entropy = token_logprobs(
            flat_hidden, head_weight, flat_targets, self.chunk_size, with_entropy
        )
        if sources is not None:
            return picked, entropy
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        zeros = torch.zeros(input_ids.shape[0], 1, device=hidden.device)
        logprobs = torch.cat([zeros, picked.view(shape)], dim=1)
        entropies = torch.cat([zeros, entropy.view(shape)], dim=1)
        if attention_mask is None:
            return logprobs, entropies
        mask = attention_mask.to(logprobs.dtype)
        return logprobs * mask, entropies * mask
