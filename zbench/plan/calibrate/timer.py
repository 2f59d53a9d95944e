"""Median time of a short operation on a device: CUDA events on a GPU, the wall clock on a CPU.

Note: a repeat count fixed in advance is either too few for a microsecond kernel or minutes for a large one
on a 2-core machine; each measurement repeats until it has run ``budget_s`` or ``max_repeats`` times (at
least ``min_repeats``), after one untimed warm-up call (allocations, kernel selection, connections).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zbench.measure.timing import synchronize


@dataclass(frozen=True)
class Timer:
    device: torch.device
    budget_s: float = 0.3
    min_repeats: int = 3
    max_repeats: int = 50

    def median_s(self, fn: Callable[[], object]) -> float:
        """Median seconds of one call of ``fn`` (device work included)."""
        fn()
        synchronize(self.device)
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < self.min_repeats or (
            len(times) < self.max_repeats and time.perf_counter() - started < self.budget_s
        ):
            times.append(self._once(fn))
        return statistics.median(times)

    def _once(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin
