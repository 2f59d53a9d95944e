"""Two calibrations figure by figure: how far a machine's figures moved between two ``zbench calibrate`` runs
(or between a calibration and a profile's published figures).

Note: a single calibration is one sample of a machine whose speed can drift (up to 3x between minutes on a
shared host); before a profile is trusted for a prediction, the same figures measured apart say how much
of a prediction's error could be the profile's.
"""

from __future__ import annotations

from dataclasses import dataclass

from zbench.plan.simulate.cluster import Cluster
from zbench.results.formatting import fmt_bytes


@dataclass(frozen=True)
class Difference:
    figure: str
    first: float | None
    second: float | None

    @property
    def ratio(self) -> float | None:
        """``second / first``; None where either side lacks the figure or the first is zero."""
        if self.first is None or self.second is None or self.first == 0:
            return None
        return self.second / self.first


def _figures(profile: Cluster) -> dict[str, float]:
    """Every figure of a profile by a stable name: the scalars the step model reads, then the measured tables."""
    out: dict[str, float] = {
        "peak_tflops": profile.peak_tflops,
        "efficiency": profile.efficiency,
        "intra_node.bandwidth_gb_s": profile.intra_node.bandwidth_gb_s,
        "intra_node.latency_us": profile.intra_node.latency_us,
        "inter_node.bandwidth_gb_s": profile.inter_node.bandwidth_gb_s,
        "inter_node.latency_us": profile.inter_node.latency_us,
        "pcie_gb_s": profile.pcie_gb_s,
        "nvme_gb_s_per_node": profile.nvme_gb_s_per_node,
        "host_adam_params_per_s": profile.host_adam_params_per_s,
    }
    cal = profile.calibration
    if cal is None:
        return out
    for p in cal.matmul:
        out[f"matmul {p.dtype} {p.m}x{p.k}x{p.n} tflops"] = p.tflops
    sizes = {b.bytes for b in cal.memory_bound}
    for b in cal.memory_bound:
        out[f"{b.op} {fmt_bytes(b.bytes)} gb_s" if len(sizes) > 1 else f"{b.op} gb_s"] = b.gb_s
    for c in cal.collectives:
        name = c.op if c.ranks == cal.ranks else f"{c.op} over {c.ranks}"
        out[f"{name} latency_us"] = c.latency_us
        out[f"{name} bandwidth_gb_s"] = c.bandwidth_gb_s
    for kind, gb_s in cal.copies_gb_s.items():
        out[f"copy {kind} gb_s"] = gb_s
    out["hook_call_us"] = cal.hook_call_us
    if cal.op_call_us is not None:
        out["op_call_us"] = cal.op_call_us
    if cal.mapped_gb_s is not None:
        out["mapped_gb_s"] = cal.mapped_gb_s
    if cal.thread_speedup is not None:
        out["thread_speedup"] = cal.thread_speedup
    if cal.collective_issue_us is not None:
        out["collective_issue_us"] = cal.collective_issue_us
    if cal.disk is not None:
        out["disk write_gb_s"], out["disk read_gb_s"] = cal.disk.write_gb_s, cal.disk.read_gb_s
    for label, by_dtype in (("step residual", cal.step_residuals), ("thread speed-up", cal.thread_speedups),
                             ("co-run slow-down", cal.corun_slowdowns)):  # fmt: skip
        for dtype, points in by_dtype.items():
            for i, (_, value) in enumerate(points, 1):  # by the probe's place in charge: its seconds drift
                out[f"{label} {dtype} probe {i} of {len(points)}"] = value
    for op, points in cal.operator_factors.items():
        for size, factor in points:  # by the size per call it was measured at (FLOPs, else bytes moved)
            out[f"{op} factor at {size:.3g}"] = factor
    return out


def compare(first: Cluster, second: Cluster) -> list[Difference]:
    """Every figure either profile has, in the first's order, then the second's extras."""
    a, b = _figures(first), _figures(second)
    names = list(a) + [name for name in b if name not in a]
    return [Difference(name, a.get(name), b.get(name)) for name in names]
