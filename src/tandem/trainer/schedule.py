"""Learning-rate schedules of the policy optimizer, as ``LambdaLR`` factors."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from tandem.config.models import OptimizerConfig


def lr_factor(config: OptimizerConfig, total_steps: int | None) -> Callable[[int], float]:
    """Linear warm-up from lr/warmup_steps to lr, then constant, cosine or linear decay to
    ``min_lr_ratio * lr`` at ``total_steps`` (``config.total_steps`` wins when set)."""
    total = config.total_steps or total_steps
    if config.schedule != "constant" and total is None:
        raise ValueError(
            f"optimizer.schedule={config.schedule!r} needs a length: set optimizer.total_steps "
            "or pass total_steps to PolicyTrainer"
        )
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        assert total is not None
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if config.schedule == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape

    return factor


def build_optimizer(
    parameters: list[torch.nn.Parameter], config: OptimizerConfig, total_steps: int | None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    adam: dict[str, Any] = dict(
        lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )
    optimizer: torch.optim.Optimizer
    if config.bf16_stochastic_round:
        optimizer = _stochastic_round_adamw()(parameters, **adam, bf16_stochastic_round=True)
    else:
        # fused: one kernel over all parameters instead of torch's per-tensor loop off CUDA
        # (figures: docs/benchmarks/2026-12-05-cpu-e2e-amd.md); torchtitan's default on GPUs
        optimizer = torch.optim.AdamW(parameters, **adam, fused=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config, total_steps))


def _stochastic_round_adamw() -> Any:
    """torchao's AdamW, which rounds bf16 weights stochastically (its step is compiled for each
    parameter shape: Inductor, with a C++ compiler on a CPU)."""
    # its import reports the CUDA kernels it cannot load on this machine and a torch deprecation
    # of its own, neither of which concerns the optimizer
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.optim import _AdamW
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return _AdamW
