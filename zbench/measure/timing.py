"""Step timing and the statistics reported for it (median and interquartile range, warm-up excluded)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so a wall-clock reading covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], *, device: torch.device, barrier: Callable[[], None]) -> tuple[T, float]:
    """Run ``fn`` from a barrier (every rank starts together) and return its result and this rank's wall time.

    There is no closing barrier: the record takes the slowest rank's time of each step, which is
    what a closing barrier would measure, without paying for a second collective every step
    (on a busy 2-core machine that collective was a few percent of a small model's step).
    """
    synchronize(device)
    barrier()
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def summarize(samples: Sequence[float]) -> dict[str, float | None]:
    """Median, quartiles and IQR of timed samples (``None`` when there are none)."""
    if not samples:
        return {"median": None, "q1": None, "q3": None, "iqr": None, "min": None, "max": None}
    if len(samples) == 1:
        q1 = q3 = samples[0]
    else:
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return {
        "median": statistics.median(samples),
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "min": min(samples),
        "max": max(samples),
    }
