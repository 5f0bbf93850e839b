"""Counting aten calls at the dispatcher (``TorchDispatchMode``): on a GPU each call that reads
or writes tensor data launches at least one kernel, so a count taken on the CPU tells how
launch-bound the same code is there. The benchmarks and the tests that count calls use this."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class AtenCalls(TorchDispatchMode):
    """Counts aten calls by name while active: ``with AtenCalls() as calls: ...``, then
    ``calls.count`` (all) or ``calls.calls`` (by name). ``data_only``: only the calls that read
    or write tensor data (views and allocations left out; ``from_file`` maps shared memory)."""

    NO_DATA = frozenset({"empty", "empty_like", "empty_strided", "set_", "lift_fresh", "from_file"})

    def __init__(self, data_only: bool = True) -> None:
        super().__init__()
        self.data_only = data_only
        self.calls: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self.data_only or not (func.is_view or name in self.NO_DATA):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))
