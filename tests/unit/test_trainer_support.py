"""Shared helpers of the trainer tests (no tests here): a tiny random Qwen2 written to disk,
batches, a token-NLL loss following the loss contract, a 2-rank gloo launcher."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import transformers

from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch

VOCAB = 300


def write_tiny_qwen2(path: Path, tied: bool, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return path


def make_batch(seed: int = 0, size: int = 8, width: int = 12) -> TrainBatch:
    """Right-padded rows of random lengths; the first 3 tokens are the prompt."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, width), generator=gen)
    lengths = torch.randint(width // 2, width + 1, (size,), generator=gen)
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    loss_mask = attention.float()
    loss_mask[:, :3] = 0
    return TrainBatch(ids * attention, attention, loss_mask)


def token_nll(
    logprobs: torch.Tensor,
    micro_batch: TrainBatch,
    num_global_tokens: float,
    num_global_sequences: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean NLL over the trained tokens of the whole global batch (the loss contract)."""
    mask = micro_batch.loss_mask.to(logprobs.dtype)
    loss = -(logprobs * mask).sum() / num_global_tokens
    return loss, {"tokens_seen": mask.sum() / num_global_tokens}


def policy(model_dir: Path, **kwargs: Any) -> PolicyConfig:
    # a large eps keeps Adam from amplifying float rounding of near-zero gradients to ±lr
    optimizer = kwargs.pop("optimizer", OptimizerConfig(lr=1e-2, eps=1e-3, max_grad_norm=1.0))
    return PolicyConfig(model_path=model_dir, optimizer=optimizer, **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
        if torch.distributed.is_initialized():
            # every rank done before any tears its group down: a rank that destroyed its gloo
            # group while another still worked (rank 0 saving its results) could abort the
            # other's process ("terminate called without an active exception")
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def spawn(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (a gloo group on a
    free port); raises if any rank fails."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size)
