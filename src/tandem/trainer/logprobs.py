"""Token logprobs from a causal LM without materialising full-vocabulary fp32 logits for the
whole batch: the LM head and log-softmax run over chunks of tokens."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # the head runs in the model dtype (tensor cores for bf16, as vLLM does); softmax in fp32,
    # and only one chunk of fp32 logits exists at a time
    logits = F.linear(hidden, head_weight).float()
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros_like(picked)
    return picked, entropy


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
    Without gradients each chunk's logits are freed before the next chunk. With gradients,
    autograd would keep every chunk's logits (and their softmax) for backward, so each chunk runs
    under ``torch.utils.checkpoint``: backward keeps only the chunk's hidden states and
    recomputes one chunk's logits at a time (one extra LM-head matmul per chunk).
    """

    def __init__(self, lm: nn.Module, chunk_size: int):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        with_entropy: bool = False,
        position_ids: torch.Tensor | None = None,
        sources: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A right-padded ``attention_mask`` only zeroes the padding's outputs: the model runs
        causal without it (``right_padded``).

        Packed layouts (``tandem.data.packing``) pass their ``position_ids``, their 4D
        ``attention_mask`` or None (block-diagonal from positions that restart), and the
        pairs to score: ``targets[i]`` as predicted by the hidden state at flat position
        ``sources[i]`` of ``input_ids``; the results are then ``[n]``, one per pair."""
        lm: Any = self.lm  # a Hugging Face PreTrainedModel
        body = lm.get_decoder()
        if sources is None:
            body_mask = (
                None if attention_mask is None or right_padded(attention_mask) else attention_mask
            )
        else:
            body_mask = attention_mask
        hidden = body(
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
        picked, entropy = [], []
        for start in range(0, flat_targets.numel(), self.chunk_size):
            h = flat_hidden[start : start + self.chunk_size]
            t = flat_targets[start : start + self.chunk_size]
            if torch.is_grad_enabled():
                lp, ent = checkpoint(
                    _chunk_logprobs, h, head_weight, t, with_entropy, use_reentrant=False
                )
            else:
                lp, ent = _chunk_logprobs(h, head_weight, t, with_entropy)
            picked.append(lp)
            entropy.append(ent)
        if sources is not None:
            empty = hidden.new_zeros(0, dtype=torch.float32)
            return torch.cat(picked) if picked else empty, torch.cat(entropy) if entropy else empty
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        zeros = torch.zeros(input_ids.shape[0], 1, device=hidden.device)
        logprobs = torch.cat([zeros, torch.cat(picked).view(shape)], dim=1)
        entropies = torch.cat([zeros, torch.cat(entropy).view(shape)], dim=1)
        if attention_mask is None:
            return logprobs, entropies
        mask = attention_mask.to(logprobs.dtype)
        return logprobs * mask, entropies * mask
