"""Offload and onload of a trainer's state, keeping every tensor's identity.

Every tensor moves with ``torch.utils.swap_tensors``: the Python object stays the same and only
its data changes device, so module attributes, tied weights, the optimizer's parameter references
and any alias follow. (``p.data = p.data.to(d)`` fails for buffers under FSDP2, and rebinding a
loop variable leaves the old device copy alive.) Parameters and buffers go through
``module._apply`` with swapping switched on, which is also where FSDP2 re-derives its sharded
storage (``FSDPModule._apply`` calls ``reset_sharded_param``), so no stale device copy survives.
Host copies are pinned when CUDA is present so transfers run at bus bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        pin = torch.cuda.is_available() and tensor.device.type == "cuda"
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        return out.copy_(tensor, non_blocking=pin)
    return tensor.to(device, non_blocking=True)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # AdamW's step stays put
                yield value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor (FSDP2 optimizer state is DTensors)."""
    return getattr(tensor, "_local_tensor", tensor)


def move_module(module: nn.Module, device: torch.device) -> None:
    """Parameters, their gradients and buffers of ``module`` to ``device``, in place."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module._apply(lambda t: t if t.device == device else _moved(t, device))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for value in _optimizer_tensors(optimizer):
        local = _local(value)
        if local.device != device:
            torch.utils.swap_tensors(local, _moved(local, device))


def move_state(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> None:
    """Module and optimizer state to ``device``; returns once every copy has landed."""
    move_module(module, device)
    if optimizer is not None:
        move_optimizer(optimizer, device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
