"""Counting the aten calls that read or write tensor data: on a GPU each launches at least
one kernel, so a count taken on the CPU tells how launch-bound the same code is there."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class DataCalls(TorchDispatchMode):
    """Counts the aten calls that read or write tensor data (views and allocations left
    out) while active: ``with DataCalls() as calls: ...; calls.count``."""

    NO_DATA = frozenset({"empty", "empty_like", "empty_strided", "set_", "lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func.overloadpacket.__name__ not in self.NO_DATA:
            self.count += 1
        return func(*args, **(kwargs or {}))
