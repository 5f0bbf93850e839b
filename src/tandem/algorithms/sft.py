"""Supervised fine-tuning: token NLL on prompt/response pairs, with the same trainer as RL."""

from __future__ import annotations

import time

import torch

from tandem.algorithms.losses import nll_loss
from tandem.algorithms.protocols import RolloutRuntime
from tandem.data.batch import TrainBatch
from tandem.data.prompts import PromptSource


def sft_batch(source: PromptSource, items: list[dict[str, str]]) -> TrainBatch:
    """Prompt followed by answer + EOS, right-padded; the loss covers the answer and EOS."""
    eos = source.tokenizer.eos_token_id
    rows = []
    for item in items:
        prompt = source.encode(item["prompt"])
        response = source.encode(item["answer"]) + ([eos] if eos is not None else [])
        rows.append((prompt, response))
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.full((len(rows), width), source.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for row, (prompt, response) in enumerate(rows):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response)
        attention_mask[row, :end] = 1
        loss_mask[row, len(prompt) : end] = 1.0
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def sft_step(
    runtime: RolloutRuntime, source: PromptSource, step: int, batch_size: int
) -> dict[str, float]:
    start = time.perf_counter()
    batch = sft_batch(source, source.train_prompts(step - 1, batch_size))
    metrics = runtime.train(batch, nll_loss)
    elapsed = time.perf_counter() - start
    return {
        "train/loss": metrics["loss"],
        "train/grad_norm": metrics["grad_norm"],
        "train/lr": metrics["lr"],
        "timing/train_s": elapsed,
        "timing/step_s": elapsed,
        "throughput/tokens_per_s": float(batch.attention_mask.sum()) / elapsed,
    }
