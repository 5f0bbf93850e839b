"""Shared pieces of the LoRA tests (no tests here): a LoRA policy of the embedded model trained
a few steps, the two refit paths (a copy in this process, a colocated transport), and the
generator/trainer logprob agreement after a refit."""

from __future__ import annotations

import functools
import threading
from typing import Any, Literal

import torch

from tandem.algorithms.losses import nll_loss
from tandem.algorithms.rollouts import rollouts_to_batch
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.config.lora import LoraConfig
from tandem.config.models import GenerationConfig, OptimizerConfig, PolicyConfig, RefitConfig
from tandem.data.batch import TrainBatch
from tandem.generation import Rollout, SamplingParams

PAD = 256  # the embedded tokenizer's pad/eos id
PROMPTS = ["17+25=", "3-1=", "99+99=", "40+2="]
TRAIN = [("12+30=", "42"), ("7+8=", "15"), ("50-9=", "41"), ("6+6=", "12")]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
PARITY_ATOL = 1e-5
MERGED_ATOL = 2e-5
"""A generator on merged weights computes ``W' x`` where the trainer computes
``W x + s B (A x)``: they round differently (measured 1.2e-5 after three steps at lr 2e-2,
``trainer.lora.merged_tensors``)."""


def lora_policy(rank: int = 4, **lora: Any) -> PolicyConfig:
    # a large lr: two steps move the adapters (B starts at zero) well past the tolerances
    optimizer = OptimizerConfig(lr=2e-2, eps=1e-3)
    return PolicyConfig(optimizer=optimizer, lora=LoraConfig(rank=rank, alpha=2 * rank, **lora))


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


def encode(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False))


def train_batch() -> TrainBatch:
    rollouts = []
    for i, (prompt, answer) in enumerate(TRAIN):
        response = [*encode(answer), PAD]
        rollouts.append(Rollout(i, encode(prompt), response, answer, [0.0] * len(response)))
    return rollouts_to_batch(rollouts, PAD)


def trainer_worker(
    policy: PolicyConfig,
    generation: GenerationConfig,
    lora_refit: Literal["adapter", "merged"] = "adapter",
    steps: int = 2,
    with_reference: bool = False,
) -> TrainerWorker:
    refit = RefitConfig(transport="colocated", lora=lora_refit)
    worker = TrainerWorker(policy, refit, generation, with_reference=with_reference)
    for _ in range(steps):
        worker.train(train_batch(), nll_loss)
    return worker


def refit(
    trainer: TrainerWorker, generator: GeneratorWorker, version: int, transport: bool
) -> None:
    """The trainer's refit into the generator: through the colocated transport (a thread sends,
    as the trainer actor does) or as the in-process launcher copies it."""
    if not transport:
        generator.load_weights(trainer.weight_stream(), version)
        return
    spec = trainer.prepare_refit()
    sender = threading.Thread(target=trainer.send_weights)
    sender.start()
    generator.receive_weights(spec, version)
    sender.join(timeout=60)
    assert not sender.is_alive()


def logprob_gap(trainer: TrainerWorker, generator: GeneratorWorker) -> float:
    """Largest |generator - trainer| logprob over sampled responses to ``PROMPTS``."""
    rollouts = generator.generate([encode(p) for p in PROMPTS], SAMPLED)
    batch = rollouts_to_batch(rollouts, PAD)
    assert batch.generator_logprobs is not None
    ours = trainer.logprobs(batch)
    mask = batch.loss_mask.bool()
    return float((ours - batch.generator_logprobs)[mask].abs().max())


def stream_bytes(trainer: TrainerWorker) -> tuple[int, list[str]]:
    """Bytes and names of what a refit sends."""
    names, total = [], 0
    for name, tensor in trainer.weight_stream():
        names.append(name)
        total += tensor.numel() * tensor.element_size()
    return total, names


def model_logprobs(model: Any, batch: TrainBatch) -> torch.Tensor:
    """Token logprobs ``[B, T]`` (entry 0 and padding 0) of a transformers model."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None])
    out = torch.zeros(batch.input_ids.shape)
    out[:, 1:] = picked[..., 0]
    return out * batch.attention_mask
