"""Offload and onload of a trainer's state, keeping every tensor's identity.

Every tensor moves with ``torch.utils.swap_tensors``: the Python object stays the same and only
its data changes device, so module attributes, tied weights, the optimizer's parameter references
and any alias follow. (``p.data = p.data.to(d)`` fails for buffers under FSDP2, and rebinding a
loop variable leaves the old device copy alive.) Parameters go through ``module._apply`` with
swapping switched on, which is also where FSDP2 reshards and re-derives its sharded storage
(``FSDPModule._apply`` calls ``reset_sharded_param``), so no stale device copy survives.
``_apply`` rebinds buffers instead of swapping them, so buffers (the rotary ``inv_freq``) are
swapped here first and ``_apply`` then finds them on the target device.
Host copies are pinned when CUDA is present so transfers run at bus bandwidth; the caching host
allocator keeps the pinned blocks, so the second and later offloads do not pin again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

CPU = torch.device("cpu")


def _moved_local(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        pin = torch.cuda.is_available() and tensor.device.type == "cuda"
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        return out.copy_(tensor, non_blocking=pin)
    return tensor.to(device, non_blocking=True)


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``; a DTensor keeps its mesh, placements and shape."""
    if DTensor is not None and isinstance(tensor, DTensor):
        local = _moved_local(tensor._local_tensor, device)
        return DTensor.from_local(
            local,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return _moved_local(tensor, device)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor (FSDP2 optimizer state is DTensors)."""
    return getattr(tensor, "_local_tensor", tensor)


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers of ``module`` (rotary ``inv_freq``...) to ``device``, swapped in place."""
    for buffer in module.buffers():
        if buffer.device != device:
            torch.utils.swap_tensors(buffer, _moved(buffer, device))


def move_module(module: nn.Module, device: torch.device) -> None:
    """Parameters, their gradients and buffers of ``module`` to ``device``, in place."""
    move_buffers(module, device)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.no_grad():
            module._apply(lambda t: t if _local(t).device == device else _moved(t, device))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(state tensor, its parameter, whether it lives beside the parameter). AdamW's ``step``
    stays on the host unless the optimizer is fused or capturable."""
    for group in optimizer.param_groups:
        on_device_step = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    yield value, param, value.dim() > 0 or on_device_step


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Optimizer state to the host (``device`` is the CPU) or back beside its parameters."""
    for value, param, beside_param in _optimizer_tensors(optimizer):
        local = _local(value)
        target = CPU if device.type == "cpu" else _local(param).device
        if not beside_param and device.type != "cpu":
            continue  # a host step stays on the host
        if local.device != target:
            torch.utils.swap_tensors(local, _moved_local(local, target))


def release_device_caches() -> None:
    """Return cached device memory: cuBLAS workspaces live in the caching allocator."""
    if not torch.cuda.is_available():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def move_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    include_parameters: bool = True,
) -> None:
    """Module and optimizer state to ``device``; returns once every copy has landed. Moving to
    the host also hands cached device memory back (``release_device_caches``).

    ``include_parameters=False`` moves just the buffers (FSDP2 CPU offload keeps parameters,
    gradients and optimizer state on the host already)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if include_parameters:
        move_module(module, device)
        if optimizer is not None:
            move_optimizer(optimizer, device)
    else:
        move_buffers(module, device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if device.type == "cpu":
            # the swapped-out FSDP2 DTensors (holding the old device shards) sit in reference
            # cycles: only the cyclic collector frees them
            gc.collect()
            release_device_caches()
