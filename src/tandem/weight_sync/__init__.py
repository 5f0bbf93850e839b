"""Refit: stream the trainer's weights into the generators, bucket by bucket.

```python
sender = make_sender(refit_config, device)       # trainer rank 0 only
spec = sender.prepare(metadata)                  # picklable RefitSpec
sender.send(weight_stream)                       # concurrently with, in each generator worker:
for name, tensor in make_receiver(spec, device, rank).iter_weights(): ...
```
A live refit names the tensors at ``prepare(metadata, live_tensors)`` and sends them with
``send()`` (a colocated receiver on CUDA reads them in place). ``iter_buckets()`` yields the same
tensors a bucket at a time, for batched copies; ``copy_into(targets)`` copies them into the
tensors given, in runs where both sides allow. The transport (``split``, or ``colocated``:
``shm`` on the CPU, ``cuda`` on a GPU) is chosen here from the config and the device; callers
never branch on it. Nothing in this package imports vLLM or Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeVar

import torch

if TYPE_CHECKING:  # only .transport/.bucket_bytes are read: tests pass a SimpleNamespace too
    from tandem.config.models import RefitConfig
from tandem.weight_sync.base import RefitSender, RefitSpec, SendStats, metadata_of
from tandem.weight_sync.buckets import BucketPlan, TensorMeta, plan_buckets
from tandem.weight_sync.cuda import CudaIpcReceiver, CudaIpcSender
from tandem.weight_sync.receiver import RefitReceiver
from tandem.weight_sync.shm import ShmReceiver, ShmSender
from tandem.weight_sync.signals import RefitError
from tandem.weight_sync.split import SplitReceiver, SplitSender

__all__ = [
    "BucketPlan",
    "RefitError",
    "RefitReceiver",
    "RefitSender",
    "RefitSpec",
    "SendStats",
    "TensorMeta",
    "bucket_bytes_for",
    "make_receiver",
    "make_sender",
    "metadata_of",
    "plan_buckets",
]

_T = TypeVar("_T")

DEFAULT_BUCKET_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}
"""``refit.bucket_bytes`` when unset, by the trainer's device type. On a 2-core CPU 64 MiB
was the fastest of 16 MiB - 1 GiB (`bench/refit.py`); on a GPU small buckets leave a refit to
per-bucket signals and kernel launches (`bench/refit_gpu.py`; figures:
docs/benchmarks/2026-12-03-gpu-refit-offload-mfu.md)."""


def bucket_bytes_for(config: RefitConfig, device: torch.device) -> int:
    """``config.bucket_bytes``, or the default for ``device``'s type when it is unset."""
    if config.bucket_bytes is not None:
        return config.bucket_bytes
    return DEFAULT_BUCKET_BYTES.get(device.type, DEFAULT_BUCKET_BYTES["cuda"])


def resolve_transport(
    config: RefitConfig, placement: Literal["colocated", "split"] | None
) -> Literal["colocated", "split"]:
    """The transport of ``config``; ``auto`` follows the cluster placement."""
    if config.transport != "auto":
        return config.transport
    if placement is None:
        raise ValueError(
            "refit.transport is 'auto': pass placement=cluster.placement to make_sender, or set "
            "refit.transport to 'colocated' or 'split'"
        )
    return placement


def make_sender(
    config: RefitConfig,
    device: torch.device | str,
    *,
    num_receivers: int = 1,
    placement: Literal["colocated", "split"] | None = None,
    timeout_s: float | None = None,
    host: str = "127.0.0.1",
) -> RefitSender:
    """The refit sender of trainer rank 0 (other trainer ranks have none).

    ``num_receivers``: generator workers that receive every refit (ranks 1..N).
    ``host``: address the receivers reach the sender's store at (the trainer node's IP when
    generators run on other nodes). ``timeout_s`` bounds every wait for the other side
    (default: ``config.timeout_s``).
    """
    device = torch.device(device)
    timeout_s = config.timeout_s if timeout_s is None else timeout_s
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s}; use a positive number of seconds")
    cls: type[RefitSender] = SplitSender
    if resolve_transport(config, placement) == "colocated":
        cls = _by_device(device.type, {"cpu": ShmSender, "cuda": CudaIpcSender})
    return cls(bucket_bytes_for(config, device), device, num_receivers, timeout_s, host)


def make_receiver(spec: RefitSpec, device: torch.device | str, rank: int = 1) -> RefitReceiver:
    """The receiver of generator worker ``rank`` (1..spec.num_receivers) for one refit."""
    cls: type[RefitReceiver] = SplitReceiver
    if spec.transport == "colocated":  # by the sender's device (the receiver checks its own)
        cls = _by_device(spec.device_type, {"cpu": ShmReceiver, "cuda": CudaIpcReceiver})
    return cls(spec, torch.device(device), rank)


def _by_device(device_type: str, classes: dict[str, type[_T]]) -> type[_T]:
    if device_type not in classes:
        raise ValueError(
            f"colocated refit on {device_type!r}: it shares memory on 'cpu' or 'cuda' only; "
            "use refit.transport=split"
        )
    return classes[device_type]
