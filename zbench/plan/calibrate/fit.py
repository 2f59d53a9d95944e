"""The alpha-beta fit of a collective's measured times: ``seconds = latency + x / bandwidth``.

``x`` is the share of the ledger's bytes that crosses the slowest link under the step-time model
(``zbench.plan.simulate.step.collective_seconds``): ``(ranks-1)/ranks`` of them for ring collectives, all of
them for a broadcast. The fit minimises relative error (times span four orders of magnitude from 4 bytes to
tens of MiB, and absolute error would let the largest messages decide the latency too) with a robust loss
(``soft_l1``): on a shared host a rank descheduled mid-call turns one size's median into milliseconds, and
one such point must not move the fit.
"""

from __future__ import annotations

import statistics

import numpy as np
from scipy.optimize import least_squares

from zbench.plan.simulate.step import crossing_bytes

#: The fit's bandwidth term at the largest message must be at least this share of its latency: below it the
#: curve is flat (time does not grow with size), and any bandwidth "fitted" to it is noise.
MIN_BANDWIDTH_SHARE = 0.25


class FitError(ValueError):
    """A curve that cannot be fitted (too few sizes, or flat: noise); the message is one line."""


def fit_alpha_beta(op: str, points: list[tuple[int, float]], ranks: int) -> tuple[float, float, float]:
    """``(latency_s, bandwidth_bytes_per_s, median relative error)`` of ``points`` (ledger bytes, seconds)."""
    if len(points) < 2:
        raise FitError(f"{op}: at least two message sizes are needed to fit latency and bandwidth")
    x = np.array([crossing_bytes(op, b, ranks) for b, _ in points], dtype=float)
    t = np.array([s for _, s in points], dtype=float)
    start = np.polyfit(x, t, 1, w=1 / t)[::-1].clip(min=1e-12)  # (latency, seconds per byte)
    fit = least_squares(
        lambda ab: (ab[0] + ab[1] * x - t) / t, start, bounds=([0.0, 1e-15], [np.inf, np.inf]),
        loss="soft_l1", f_scale=0.1,
    )  # fmt: skip
    latency, slope = (float(v) for v in fit.x)
    if slope * x.max() < MIN_BANDWIDTH_SHARE * max(latency, float(t.min())):
        raise FitError(f"{op}: time does not grow with message size up to {int(x.max()):,} bytes; the curve is noise")
    predicted = latency + x * slope
    error = statistics.median(abs(p - m) / m for p, m in zip(predicted, t, strict=True))
    return latency, float(1 / slope), float(error)


def hops(op: str, ranks: int) -> int:
    """Latencies one call pays in the step-time model (``zbench.plan.simulate.step.collective_seconds``), inside
    one node: a ring's ``p-1`` steps for an all-gather or reduce-scatter, a tree's ``ceil(log2 p)`` levels for a
    broadcast, and for an all-reduce twice the fewer of the two (the model takes the faster of ring and tree,
    and for a latency the fewer hops)."""
    levels = max(1, (ranks - 1).bit_length())
    if op == "broadcast":
        return levels
    return 2 * min(ranks - 1, levels) if op == "all_reduce" else ranks - 1
