"""Plain worker classes the Ray tests run as actors (importable through PYTHONPATH=tests/; only
the standard library at import time, so they load in every actor environment)."""

from __future__ import annotations

import gc
import importlib
import os
import sys
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class EchoWorker:
    """Reports where it runs; adds; fails or dies on request; all-reduces over gloo."""

    def __init__(
        self,
        scale: int = 1,
        rank: int = 0,
        world_size: int = 1,
        fail: bool = False,
        node_ip: str = "",
    ):
        if fail:
            raise RuntimeError("constructor asked to fail")
        self.scale, self.rank, self.world_size = scale, rank, world_size
        self.node_ip = node_ip

    def info(self) -> dict[str, Any]:
        import ray

        names = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "VLLM_HOST_IP"]
        names += ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
        context = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "node_ip": self.node_ip,
            "env": {name: os.environ.get(name) for name in names},
            "pid": os.getpid(),
            "executable": sys.executable,
            "placement_group": context.get_placement_group_id(),
            "gc_enabled": gc.isenabled(),
            "gc_frozen": gc.get_freeze_count(),
        }

    def add(self, x: int) -> int:
        return x * self.scale + self.rank

    def fail(self, message: str, only_rank: int | None = None) -> None:
        if only_rank is None or only_rank == self.rank:
            raise ValueError(message)

    def run_out_of_memory(self, only_rank: int) -> None:
        """Raises what torch raises when a CUDA allocation fails."""
        if only_rank == self.rank:
            import torch

            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                "79.19 GiB of which 1.06 GiB is free. Of the allocated memory 74.2 GiB is "
                "allocated by PyTorch"
            )

    def misconfigured(self, only_rank: int) -> None:
        """Raises what tandem raises for a setting that cannot work (``ConfigError``)."""
        if only_rank == self.rank:
            from tandem.config.load import ConfigError

            raise ConfigError("policy: the trainer's state does not fit its GPU: ...")

    def exit(self, only_rank: int) -> None:
        """The process dies mid-call, as on a segfault or the OOM killer."""
        if only_rank == self.rank:
            os._exit(1)

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # from MASTER_ADDR/PORT, RANK, WORLD_SIZE
        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        dist.destroy_process_group()
        return float(tensor.item())


class ProbeWorker:
    """Reports its interpreter and whether a module imports there."""

    def probe(self, module: str) -> dict[str, Any]:
        try:
            importlib.import_module(module)
            error = None
        except ImportError as err:
            error = f"{type(err).__name__}: {err}"
        return {"executable": sys.executable, "prefix": sys.prefix, "import_error": error}
