"""Compute time of a traced step, operator by operator, from a calibrated profile (``zbench calibrate``).

Each operator the trace recorded (``zbench.plan.trace.ops``) is charged:

- if it has FLOPs (matrix products, attention): its FLOPs at the rate the calibration measured for matrix
  products of that dtype and of about that size (linear in log FLOPs between the measured points, the
  nearest point's rate beyond them; the training dtype's table where its own was not measured);
- otherwise: the bytes it reads and writes at the measured memory bandwidth (the median of ``copy`` and
  ``add``);
- every call, its dispatch cost (``op_call_us``): on a CPU added to the work (the same thread does both), on a
  GPU the larger of the two (the host launches ahead while the device works).

The optimizer step (``after_backward``) of a stage that shards it shrinks with the world size: the trace's
ops at ``traced_world`` ranks are scaled by ``traced_world / world``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Any

from zbench.plan.simulate.calibration import Calibration, MatmulPoint


def _rate_table(cal: Calibration, dtype: str) -> list[tuple[float, float]]:
    """``(log FLOPs, FLOP/s)`` of the measured products in ``dtype`` (else the first dtype measured), sorted."""
    points: list[MatmulPoint] = [p for p in cal.matmul if p.dtype == dtype] or [
        p for p in cal.matmul if p.dtype == cal.matmul[0].dtype
    ]
    return sorted((math.log(2 * p.m * p.k * p.n), p.tflops * 1e12) for p in points)


def flop_rate(cal: Calibration, dtype: str, flops: float) -> float:
    """FLOP/s for one operator of ``flops`` in ``dtype``: interpolated between measured products of nearby size."""
    table = _rate_table(cal, dtype)
    x = math.log(max(flops, 1.0))
    keys = [k for k, _ in table]
    i = bisect.bisect_left(keys, x)
    if i == 0:
        return table[0][1]
    if i == len(table):
        return table[-1][1]
    (x0, r0), (x1, r1) = table[i - 1], table[i]
    return r0 + (r1 - r0) * (x - x0) / (x1 - x0) if x1 > x0 else max(r0, r1)


def memory_bandwidth(cal: Calibration) -> float:
    return statistics.median(b.gb_s for b in cal.memory_bound) * 1e9


def op_seconds(entry: dict[str, Any], cal: Calibration, *, on_gpu: bool) -> float:
    """One traced entry (``count`` identical calls) charged as the module docstring says."""
    if entry["flops"] > 0:
        work = entry["flops"] / flop_rate(cal, entry["dtype"], entry["flops"])
    else:
        work = entry["bytes"] / memory_bandwidth(cal)
    call = (cal.op_call_us or 0.0) * 1e-6
    return entry["count"] * (max(work, call) if on_gpu else work + call)


def phase_seconds(
    ops: dict[str, list[dict[str, Any]]], cal: Calibration, *, traced_world: int, world: int, sharded_step: bool
) -> dict[str, float]:
    """Seconds of compute per phase of one rank's step at ``world`` ranks."""
    on_gpu = cal.device != "cpu"
    out = {phase: sum(op_seconds(e, cal, on_gpu=on_gpu) for e in entries) for phase, entries in ops.items()}
    if sharded_step and "after_backward" in out:
        out["after_backward"] *= traced_world / world
    return out
