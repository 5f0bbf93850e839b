"""PolicyTrainer: one trainer rank of a Hugging Face causal LM, FSDP2-sharded across ranks.

A plain class (no Ray): ``cluster/`` runs it as an actor, tests and benchmarks drive it directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.checkpoint import sharded as checkpointing
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.trainer.logprobs import LogprobModel
from tandem.trainer.offload import move_state
from tandem.trainer.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    init_distributed,
    needs_fsdp,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def lr_lambda(config: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up to 1, then constant / cosine / linear decay to ``min_lr_ratio``."""
    total = config.total_steps or total_steps

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, total - config.warmup_steps))
        shape = (
            0.5 * (1 + math.cos(math.pi * progress))
            if config.schedule == "cosine"
            else (1 - progress)
        )
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape

    return factor


def default_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class PolicyTrainer:
    """Loads ``config.model_path``, shards it with FSDP2 when there are several ranks (or mixed
    precision / CPU offload is asked for), and trains it with AdamW.

    ``trainable=False`` builds a frozen copy (the reference policy): no optimizer, logprobs only.
    """

    def __init__(
        self,
        config: PolicyConfig,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
        trainable: bool = True,
        total_steps: int = 1000,
    ):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else default_device(rank)
        self.distributed = needs_fsdp(config, world_size)
        if self.distributed:
            init_distributed(rank, world_size, self.device)
        self.lm = AutoModelForCausalLM.from_pretrained(
            str(config.model_path), dtype=DTYPES[config.dtype]
        )
        self.lm.config.use_cache = False
        if config.activation_checkpointing:
            apply_activation_checkpointing(self.lm)
        self.model = LogprobModel(self.lm, config.logprob_chunk_size)
        if self.distributed:
            self.model.to(self.device)
            apply_fsdp(self.model, self.lm, config)
        else:
            self.model.to(self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if trainable:
            opt = config.optimizer
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=opt.lr,
                betas=opt.betas,
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lr_lambda(opt, total_steps)
            )
        else:
            self.model.requires_grad_(False)
        self.step = 0

    # -- forward ----------------------------------------------------------------------------
    def _forward(self, batch: TrainBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(
            batch.input_ids.to(self.device),
            batch.attention_mask.to(self.device),
            with_entropy=with_entropy,
        )

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> Any:
        """Token logprobs ``[B, T]`` (on CPU), micro-batch by micro-batch; with
        ``with_entropy`` also the entropy of every prediction."""
        self.model.eval()
        outs, ents = [], []
        for start in range(0, batch.num_sequences, self.config.micro_batch_size):
            mb = batch.select(slice(start, start + self.config.micro_batch_size))
            logprobs, entropy = self._forward(mb, with_entropy)
            outs.append(logprobs.float().cpu())
            ents.append(entropy.float().cpu())
        if with_entropy:
            return torch.cat(outs), torch.cat(ents)
        return torch.cat(outs)

    # -- training ---------------------------------------------------------------------------
    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        if self.distributed and dist.is_initialized() and self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values)
        return values.cpu()

    def train(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's shard ``batch``.

        The loss is normalised by the token/sequence counts of the whole batch across all
        micro-batches and ranks, so accumulating micro-batches equals the full-batch step, and
        the FSDP gradient average over ranks is undone by scaling with the world size.
        """
        assert self.optimizer is not None and self.scheduler is not None, "frozen trainer"
        self.model.train()
        counts = torch.tensor(
            [batch.loss_mask.sum().item(), (batch.loss_mask.sum(-1) > 0).sum().item()],
            dtype=torch.float64,
        )
        num_tokens, num_sequences = self._all_reduce(counts).tolist()
        sums: dict[str, torch.Tensor] = {}
        for start in range(0, batch.num_sequences, self.config.micro_batch_size):
            mb = batch.select(slice(start, start + self.config.micro_batch_size)).to(self.device)
            logprobs, entropy = self._forward(mb, with_entropy=False)
            loss, metrics = loss_fn(logprobs, mb, num_tokens, num_sequences)
            (loss * self.world_size).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + float(value)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        keys = sorted(sums)
        reduced = self._all_reduce(torch.stack([sums[k] for k in keys])) if keys else []
        out = {k: float(v) for k, v in zip(keys, reduced, strict=True)}
        out.update(
            grad_norm=grad_norm,
            lr=float(self.scheduler.get_last_lr()[0]),
            num_tokens=num_tokens,
            num_sequences=num_sequences,
        )
        return out

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.optimizer.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # -- weights ----------------------------------------------------------------------------
    def _named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        tied = bool(getattr(self.lm.config, "tie_word_embeddings", False))
        for name, tensor in self.lm.state_dict().items():
            if tied and name == "lm_head.weight":
                continue  # loaders re-tie it to the embedding
            yield name.replace(".layer.", ".") if ".layer." in name else name, tensor

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Names, full shapes and dtypes of ``iter_weights`` (no gathering)."""
        return [(name, tuple(t.shape), t.dtype) for name, t in self._named_state()]

    def iter_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in Hugging Face names, one tensor at a time. A collective under FSDP:
        every rank iterates to the end; only rank 0 yields."""
        for name, tensor in self._named_state():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.rank == 0:
                full = full.detach()
                yield name, full.to(dtype) if dtype is not None else full
            del full

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        checkpointing.save(self, Path(path))

    def load_checkpoint(self, path: Path) -> None:
        checkpointing.load(self, Path(path))

    def export_hf(self, path: Path) -> None:
        checkpointing.export_hf(self, Path(path))

    # -- memory phases ----------------------------------------------------------------------
    def offload(self) -> None:
        """Parameters, gradients, buffers and optimizer state to (pinned) host memory."""
        move_state(self.model, self.optimizer, torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.config.cpu_offload:  # FSDP2 keeps parameters and optimizer state on the host
            return
        move_state(self.model, self.optimizer, self.device)
