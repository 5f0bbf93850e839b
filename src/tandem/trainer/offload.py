"""Offload and onload of a trainer's state, keeping every tensor's identity.

Every tensor moves with ``torch.utils.swap_tensors``: the Python object stays the same and only
its data changes device, so module attributes, tied weights, the optimizer's parameter references
and any alias follow. (``p.data = p.data.to(d)`` fails for buffers under FSDP2, and rebinding a
loop variable leaves the old device copy alive.)

Only plain tensors are swapped. A DTensor (an FSDP2 parameter, its gradient, its optimizer
state) keeps its object and gets a new local tensor of the same identity. FSDP2 keeps a second
view of each shard (``FSDPParam._sharded_param_data``, the padded all-gather input): it is moved
as the unit and the parameter's local shard becomes a view of it again, so no stale device copy
survives. (Swapping whole DTensor parameters, as ``module._apply`` does, left one device copy of
every shard alive on torch 2.11 + CUDA.)

Host copies are pinned when CUDA is present so transfers run at bus bandwidth; the caching host
allocator keeps the pinned blocks, so the second and later offloads do not pin again. Onload
reserves the device memory it needs in one allocation first, so the per-tensor allocations that
follow are carved from one cached segment instead of one ``cudaMalloc`` each. The parameters are
carved from one allocation, back to back in order, the trainable ones first
(``tensors.copies.device_copies``): a live colocated refit maps that one segment
(``weight_sync.cuda_ipc``), a generator laid out alike copies a bucket of them at once, and a
LoRA policy's adapters lie together for its adapter refits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tandem.tensors.copies import device_copies
from tandem.tensors.devices import release_device_caches, reserve_segment
from tandem.tensors.pinned import pinned_bytes
from tandem.trainer.parallelize import reshard

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = FSDPModule = None  # type: ignore[assignment,misc]

CPU = torch.device("cpu")


class HostPool:
    """Pinned host memory for a trainer's offloads, pinned ahead of the first one.

    Pinning is what makes a first offload slow (a few GB/s against the ~50 of later ones on an
    H200; figures: docs/benchmarks/2026-12-03-gpu-refit-offload-mfu.md): ``cudaHostAlloc``
    locks every page. ``start()`` pins one buffer of the
    expected size in a background thread while the trainer has other work (loading, the first
    generation); every offload then carves its host copies from it. Each offload moves the
    whole state and each onload moves all of it back, so an offload always starts with the
    pool unused (``reset``). A tensor that does not fit gets its own pinned block as before.
    """

    ALIGN = 256

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._thread: threading.Thread | None = None
        self._offset = 0
        self.pin_seconds = 0.0
        """How long pinning took (in the background)."""

    def start(self, num_bytes: int) -> None:
        def pin() -> None:
            start = time.perf_counter()
            self._buffer = pinned_bytes(num_bytes)  # (torch's allocator rounds up to 2^k)
            self.pin_seconds = time.perf_counter() - start

        self._thread = threading.Thread(target=pin, name="tandem-pin-host", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        if self._thread is not None:
            self._thread.join()  # a first offload that comes early waits for the pinning
            self._thread = None
        self._offset = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised host tensor carved from the pool, or None when it is full."""
        if self._buffer is None:
            return None
        num_bytes = shape.numel() * dtype.itemsize
        start = -(-self._offset // self.ALIGN) * self.ALIGN
        if start + num_bytes > self._buffer.numel():
            return None
        self._offset = start + num_bytes
        return self._buffer[start : start + num_bytes].view(dtype).view(shape)


def _moved(
    tensor: torch.Tensor, device: torch.device, pool: HostPool | None = None
) -> torch.Tensor:
    """A copy of the plain ``tensor`` on ``device``: pinned on the host when it leaves a GPU
    (from ``pool`` when it has room)."""
    if device.type == "cpu":
        pin = torch.cuda.is_available() and tensor.device.type == "cuda"
        out = pool.take(tensor.shape, tensor.dtype) if pin and pool is not None else None
        if out is None:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        return out.copy_(tensor, non_blocking=pin)
    return tensor.to(device, non_blocking=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor (FSDP2 parameters, gradients, optimizer state)."""
    return getattr(tensor, "_local_tensor", tensor)


def _swap(tensor: torch.Tensor, device: torch.device, pool: HostPool | None = None) -> None:
    """Move the plain ``tensor`` to ``device`` in place (same object, new data)."""
    if tensor.device != device:
        torch.utils.swap_tensors(tensor, _moved(tensor, device, pool))


def _fsdp_params(module: nn.Module) -> list[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of every FSDP module under ``module``."""
    found: list[Any] = []
    if FSDPModule is None:
        return found
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # a list since torch 2.12
        if groups is None:
            group = state._fsdp_param_group
            groups = [group] if group is not None else []
        for group in groups:
            found.extend(group.fsdp_params)
    return found


def _move_fsdp_param(
    fsdp_param: Any, device: torch.device, moved: torch.Tensor | None, pool: HostPool | None
) -> None:
    """The padded shard moves (to ``moved`` when given); the parameter's local shard (same
    object) becomes its view."""
    padded = fsdp_param._sharded_param_data
    if padded.device == device:
        return
    moved = _moved(padded, device, pool) if moved is None else moved
    local = fsdp_param.sharded_param._local_tensor
    # FSDP2 shards dim 0, so the unpadded shard is a prefix of the flat padded data
    torch.utils.swap_tensors(local, moved[: local.numel()].view(local.shape))
    fsdp_param._sharded_param_data = moved


def _move_parameter(
    param: nn.Parameter, device: torch.device, moved: torch.Tensor | None, pool: HostPool | None
) -> None:
    """``param`` (its data becomes ``moved`` when given) and its gradient to ``device``."""
    grad = param.grad
    if DTensor is not None and isinstance(param, DTensor):
        _swap(param._local_tensor, device, pool)  # no-op for FSDP2 shards: moved by FSDPParam
    elif param.device != device:
        param.grad = None  # the reference from .grad would block the swap
        data = _moved(param.detach(), device, pool) if moved is None else moved
        swapped = nn.Parameter(data, requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, swapped)
    if grad is not None:
        _swap(_local(grad), device, pool)
        param.grad = grad


def _parameters(module: nn.Module, trainable_only: bool = False) -> Iterator[nn.Parameter]:
    """Every parameter once (tied weights are one object); ``trainable_only``: those that
    require gradients."""
    seen: set[int] = set()
    for param in module.parameters():
        if trainable_only and not param.requires_grad:
            continue
        if id(param) not in seen:
            seen.add(id(param))
            yield param


def move_buffers(module: nn.Module, device: torch.device, pool: HostPool | None = None) -> None:
    """Buffers of ``module`` (rotary ``inv_freq``...) to ``device``, swapped in place."""
    for buffer in module.buffers():
        _swap(_local(buffer), device, pool)


def layout_order(
    params: list[nn.Parameter], first: Sequence[torch.Tensor] = ()
) -> list[nn.Parameter]:
    """The order a move to the GPU lays ``params`` out in: the trainable ones first, ``first``
    ahead of them in its order, then model order: a LoRA policy's adapters come back back to
    back in the order a refit streams them (``lora.Adapters.scaled_copy``)."""
    ahead = {id(p): i for i, p in enumerate(first)}
    return sorted(params, key=lambda p: (not p.requires_grad, ahead.get(id(p), len(ahead))))


def move_module(
    module: nn.Module,
    device: torch.device,
    pool: HostPool | None = None,
    trainable_only: bool = False,
    first: Sequence[torch.Tensor] = (),
) -> None:
    """Parameters, their gradients and buffers of ``module`` to ``device``, in place;
    ``trainable_only``: the parameters that require gradients (and theirs) alone, the frozen
    ones and the buffers stay where they are (a LoRA policy's base). ``first``: parameters
    laid out ahead of the other trainable ones, in this order (a LoRA policy's adapters in
    the order a refit streams them)."""
    fsdp_params = _fsdp_params(module)
    if trainable_only:
        fsdp_params = [fp for fp in fsdp_params if fp.sharded_param.requires_grad]
    if fsdp_params:
        reshard(module)  # a gathered module registers its unsharded parameters instead
    params = layout_order(list(_parameters(module, trainable_only)), first)
    with torch.no_grad():
        # The parameters' data, from FSDP2's padded shards or the parameters themselves.
        sources: list[torch.Tensor] = [fp._sharded_param_data for fp in fsdp_params]
        sources += [p for p in params if DTensor is None or not isinstance(p, DTensor)]
        sources = [t for t in sources if t.device != device]
        moved: dict[int, torch.Tensor] = {}
        if device.type == "cuda":  # one allocation, back to back (see the module docstring)
            copies = device_copies([t.detach() for t in sources], device)
            moved = {id(t): copy for t, copy in zip(sources, copies, strict=True)}
        for fsdp_param in fsdp_params:
            padded = moved.get(id(fsdp_param._sharded_param_data))
            _move_fsdp_param(fsdp_param, device, padded, pool)
        for param in params:
            _move_parameter(param, device, moved.get(id(param)), pool)
        if not trainable_only:
            move_buffers(module, device, pool)


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


def move_optimizer(
    optimizer: torch.optim.Optimizer, device: torch.device, pool: HostPool | None = None
) -> None:
    """Optimizer state to the host (``device`` is the CPU) or back beside its parameters."""
    for value, param, beside_param in _optimizer_tensors(optimizer):
        if not beside_param and device.type != "cpu":
            continue  # a host step stays on the host
        _swap(_local(value), CPU if device.type == "cpu" else _local(param).device, pool)


def _host_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the parameters, gradients and optimizer state now on the host."""
    tensors = [_local(p) for p in _parameters(module)]
    tensors += [_local(p.grad) for p in _parameters(module) if p.grad is not None]
    if optimizer is not None:
        tensors += [_local(v) for v, _, beside in _optimizer_tensors(optimizer) if beside]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def move_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    include_parameters: bool = True,
    pool: HostPool | None = None,
    trainable_only: bool = False,
    first: Sequence[torch.Tensor] = (),
    weights: bool = True,
) -> None:
    """Module and optimizer state to ``device``; returns once every copy has landed. Moving to
    the host also hands cached device memory back (``release_device_caches``); its host
    copies come from ``pool`` where it has room.

    ``include_parameters=False`` moves just the buffers (FSDP2 CPU offload keeps parameters,
    gradients and optimizer state on the host already). ``trainable_only`` moves the
    parameters that require gradients, their gradients and the optimizer state, and leaves the
    frozen parameters and the buffers (``policy.lora.offload_base=false``). ``weights=False``
    moves the optimizer state alone (``policy.offload_weights=false``). ``first``: as
    ``move_module``'s."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if pool is not None and device.type == "cpu":
        pool.reset()
    if not include_parameters:
        move_buffers(module, device, pool)
    else:
        if device.type == "cuda":
            reserve_segment(device, _host_bytes(module, optimizer))
        if weights:
            move_module(module, device, pool, trainable_only, first)
        if optimizer is not None:
            move_optimizer(optimizer, device, pool)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if device.type == "cpu":
            release_device_caches()


def offload_bytes(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainable_only: bool = False,
    weights: bool = True,
) -> int:
    """What an offload of ``module`` and ``optimizer`` will move to the host, before the first
    optimizer step too: parameters, buffers and (Adam's two moments per parameter, when the
    state does not exist yet) the optimizer state, with alignment slack. ``trainable_only``,
    ``weights``: as ``move_state``'s (no frozen parameters, no buffers; no parameters)."""
    params = [_local(p) for p in _parameters(module, trainable_only)]
    buffers = [] if trainable_only or not weights else [_local(b) for b in module.buffers()]
    moved = [*params, *buffers] if weights else []
    total = sum(t.numel() * t.element_size() for t in moved)
    if optimizer is not None:
        states = [_local(v) for v, _, beside in _optimizer_tensors(optimizer) if beside]
        if states:
            total += sum(t.numel() * t.element_size() for t in states)
        else:
            trainable = [_local(p) for p in _parameters(module) if p.requires_grad]
            total += 2 * sum(t.numel() * t.element_size() for t in trainable)
    count = len(params) * 3 + len(buffers)  # each parameter and its moments, aligned
    return total + count * HostPool.ALIGN
