"""Supervised fine-tuning: token NLL on prompt/response pairs, with the same trainer as RL."""

from __future__ import annotations

import time

from tandem.algorithms.losses import nll_loss
from tandem.algorithms.protocols import RolloutRuntime, worker_metrics
from tandem.data.batch import TrainBatch, right_padded
from tandem.data.prompts import PromptSource


def sft_batch(source: PromptSource, items: list[dict[str, str]]) -> TrainBatch:
    """Prompt followed by answer + EOS, right-padded; the loss covers the answer and EOS."""
    eos = source.tokenizer.eos_token_id
    rows = []
    for item in items:
        prompt = source.encode_prompt(item)
        response = source.encode(item["answer"]) + ([eos] if eos is not None else [])
        rows.append((prompt, response))
    return right_padded(rows, source.pad_token_id)


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
        **worker_metrics(metrics),
    }
