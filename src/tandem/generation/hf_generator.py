"""The transformers backend: a fallback generator and the reference the vLLM one is tested
against.

It runs its own decode loop over the Hugging Face model (prefill, then one token per step with
the KV cache, left-padded batches) instead of ``model.generate``, for two reasons: each sample
gets its own seeded RNG stream (results do not depend on batch composition, like vLLM's
per-request seeds), and the logprob of each sampled token is taken from the raw logits, which is
vLLM's ``raw_logprobs`` semantics (see ``tandem.generation.base``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.generation.base import FinishReason, Generator, Rollout, SamplingParams
from tandem.weight_sync import TargetRuns, device_copies, make_receiver

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Sample:
    tokens: list[int]
    logprobs: list[float]
    text: str = ""
    finish_reason: FinishReason = "length"
    done: bool = False


def _target(state: dict[str, torch.Tensor], name: str, tensor: Any) -> torch.Tensor:
    """The model's tensor that ``(name, tensor)`` of a weight stream updates (``tensor``: a
    tensor or a ``TensorMeta``; only its shape is read)."""
    if name not in state:
        raise ValueError(
            f"load_weights: {name!r} is not a parameter of the model "
            f"(expected Hugging Face names such as {next(iter(state))!r})"
        )
    if state[name].shape != tensor.shape:
        raise ValueError(
            f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(state[name].shape)}"
        )
    return state[name]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to ``[B, V]`` logits (-inf outside the support)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HfGenerator(Generator):
    """Generates with a transformers ``AutoModelForCausalLM`` in this process."""

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 256,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (got {dtype!r})")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype])
        # The parameters back to back in one allocation, as a trainer's after onload(): a refit
        # then copies runs of them at once (weight_sync.copies).
        params = list(self.model.parameters())
        with torch.no_grad():
            copies = device_copies([p.detach() for p in params], self.device)
        for param, copy in zip(params, copies, strict=True):
            torch.utils.swap_tensors(param, nn.Parameter(copy, requires_grad=param.requires_grad))
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # the buffers
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else next(iter(self.eos_token_ids), 0))
        self.max_batch_size = max_batch_size
        self._refit_targets: TargetRuns | None = None  # the parameters in a refit's order

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(params.n)]
        rollouts: list[Rollout] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            prompts = [prompt_token_ids[i] for i, _ in chunk]
            seeds = [params.sample_seed(i, j) for i, j in chunk]
            for (i, _), sample in zip(
                chunk, self._generate_batch(prompts, seeds, params), strict=True
            ):
                rollouts.append(
                    Rollout(
                        prompt_index=i,
                        prompt_token_ids=list(prompt_token_ids[i]),
                        response_token_ids=sample.tokens,
                        response_text=sample.text,
                        response_logprobs=sample.logprobs,
                        finish_reason=sample.finish_reason,
                    )
                )
        return rollouts

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], seeds: list[int | None], params: SamplingParams
    ) -> list[_Sample]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: the next token is at the end
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        rngs = [self._rng(seed) for seed in seeds]
        samples = [_Sample([], []) for _ in prompts]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
        )
        for _ in range(params.max_tokens):
            logits = out.logits[:, -1, :].float()
            tokens = self._sample(logits, rngs, params)
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
            for row, sample in enumerate(samples):
                if not sample.done:
                    self._append(sample, int(tokens[row]), float(logprobs[row]), params)
            if all(s.done for s in samples):
                break
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones((len(prompts), 1))], 1
            )
            position_ids = position_ids[:, -1:] + 1
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        for sample in samples:
            if not sample.done:
                sample.text = self._decode(sample.tokens)
        return samples

    def _rng(self, seed: int | None) -> torch.Generator:
        rng = torch.Generator(device=self.device)
        if seed is None:
            rng.seed()
        else:
            rng.manual_seed(seed)
        return rng

    def _sample(
        self, logits: torch.Tensor, rngs: list[torch.Generator], params: SamplingParams
    ) -> torch.Tensor:
        if params.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(filter_logits(logits, params), dim=-1)
        picks = [torch.multinomial(probs[row], 1, generator=rng) for row, rng in enumerate(rngs)]
        return torch.cat(picks)

    def _append(self, sample: _Sample, token: int, logprob: float, params: SamplingParams) -> None:
        sample.tokens.append(token)
        sample.logprobs.append(logprob)
        if token in self.eos_token_ids:
            sample.done, sample.finish_reason = True, "stop"
            sample.text = self._decode(sample.tokens)
            return
        if params.stop:
            text = self._decode(sample.tokens)
            cuts = [text.find(s) for s in params.stop if s in text]
            if cuts:
                sample.done, sample.finish_reason, sample.text = True, "stop", text[: min(cuts)]
                return
        if len(sample.tokens) >= params.max_tokens:
            sample.done, sample.text = True, self._decode(sample.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    @torch.no_grad()
    def load_weights(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()
        for name, tensor in stream:
            _target(state, name, tensor).copy_(tensor)
        # no prefix cache to reset: every generate call prefills from scratch

    @torch.no_grad()
    def receive_weights(self, spec: Any, first_rank: int = 1) -> None:
        """As ``load_weights`` of the refit's stream, with batched copies per bucket
        (``RefitReceiver.copy_into``). The parameters never move, so where they lie is worked
        out once per plan and kept."""
        targets = self._refit_targets
        if targets is None or targets.checked != spec.plan.key:  # the first refit of its plan
            state = self.model.state_dict()
            targets = TargetRuns([_target(state, meta.name, meta) for meta in spec.plan.tensors])
            self._refit_targets = targets
        make_receiver(spec, self.device, rank=first_rank).copy_into(targets)

    def shutdown(self) -> None:
        del self.model
