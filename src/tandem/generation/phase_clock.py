"""Where a decode loop's time goes, by named part, without a host sync per step."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch


class PhaseClock:
    """``mark(part)`` charges the time since the previous mark (or ``start``) to ``part``.

    On a GPU each mark is a CUDA event recorded on the current stream, so a part's time is the
    device's from one mark to the next, the time it sat waiting for the host included (a part
    that ends in a host sync carries the round trip); ``seconds`` synchronises once and sums.
    On a CPU the marks are ``perf_counter`` readings."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any, Any]] = []
        self._last: Any = None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        self._last = self._now()

    def mark(self, part: str) -> None:
        now = self._now()
        self._marks.append((part, self._last, now))
        self._last = now

    def seconds(self) -> dict[str, float]:
        """Each part's seconds since ``start``."""
        totals: dict[str, float] = defaultdict(float)
        if self.cuda and self._marks:
            self._marks[-1][2].synchronize()
        for part, begin, end in self._marks:
            totals[part] += begin.elapsed_time(end) / 1e3 if self.cuda else end - begin
        return dict(totals)
