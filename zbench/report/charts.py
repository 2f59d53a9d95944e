"""The report's charts as plain plotly specs (``{"data": [...], "layout": {...}}``), drawn in the page by plotly.js.

A spec is JSON the page embeds and ``zbench-report.js`` hands to ``Plotly.newPlot``; building plotly's Python
figure objects instead costs tens of milliseconds a chart (validation), which at 500 case pages with three
charts each is most of the render time. Each function returns ``None`` when it has nothing to draw.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from zbench.report.history import Point
from zbench.results.record import CaseRecord
from zbench.values import CATEGORIES, LOCATIONS

Spec = dict[str, Any]

MIB = 2**20


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "template": "plotly_white",
        "height": 380,
        "margin": {"l": 60, "r": 20, "t": 50, "b": 120},
        "legend": {"orientation": "h"},
        **extra,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _ok(records: list[CaseRecord]) -> list[CaseRecord]:
    return [r for r in records if r.ok]


def setup_label(r: CaseRecord) -> str:
    """What distinguishes a case within one model: implementation, stage, offload (and world, precision)."""
    c = r.config
    twin = " twin" if c.noise_twin else ""
    return f"{c.implementation}{twin} s{c.stage} {c.offload} w{c.world_size} {c.precision}"


def by_setup_chart(records: list[CaseRecord], metric: str) -> Spec | None:
    """Step time or peak memory per implementation and stage, one group of bars per model."""
    ok = [r for r in _ok(records) if r.step_time_median_s is not None]
    if not ok:
        return None

    def value(r: CaseRecord) -> float | None:
        if metric == "time":
            return _ms(r.step_time_median_s)
        return None if r.peak_bytes is None else r.peak_bytes / MIB

    title, axis = (
        ("Median step time by setup (ms)", "ms") if metric == "time" else ("Peak memory per rank by setup (MiB)", "MiB")
    )
    models: dict[str, list[CaseRecord]] = defaultdict(list)
    for r in ok:
        models[r.config.model].append(r)
    data = [
        {"type": "bar", "name": model, "x": [setup_label(r) for r in rs], "y": [value(r) for r in rs]}
        for model, rs in models.items()
    ]
    return {"data": data, "layout": _layout(title, yaxis={"title": {"text": axis}}, barmode="group")}


def step_time_distribution_chart(records: list[CaseRecord]) -> Spec | None:
    """Every timed step of every case as a box: the spread the medians hide."""
    ok = [r for r in _ok(records) if r.timed_step_times()]
    if not ok:
        return None
    data = [
        {"type": "box", "name": r.case_id, "y": [t * 1e3 for t in r.timed_step_times()], "boxpoints": False} for r in ok
    ]
    return {
        "data": data,
        "layout": _layout(
            "Step-time distribution (ms, timed steps)", showlegend=False, yaxis={"title": {"text": "ms"}}
        ),
    }


def model_state_chart(records: list[CaseRecord]) -> Spec | None:
    """Model state per rank stacked by category and location, the formula's total beside each bar."""
    states = [(r.case_id, r.model_state) for r in _ok(records) if r.model_state is not None]
    if not states:
        return None
    ids = [case_id for case_id, _ in states]
    data: list[dict[str, Any]] = [
        {
            "type": "bar",
            "name": f"{category} ({location})",
            "x": ids,
            "y": [m.measured.get(category, {}).get(location, 0) / MIB for _, m in states if m],
        }
        for category in CATEGORIES
        for location in LOCATIONS
        if any(m.measured.get(category, {}).get(location, 0) for _, m in states if m)
    ]
    data.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "expected total (formula or declared layout)",
            "x": ids,
            "y": [m.expected_total / MIB for _, m in states if m],
            "marker": {"symbol": "line-ew-open", "size": 24, "color": "black"},
        }
    )
    return {
        "data": data,
        "layout": _layout("Model state per rank (MiB) by category and location; - marks the formula", barmode="stack"),
    }


def loss_chart(records: list[CaseRecord], reference: CaseRecord | None = None) -> Spec | None:
    """Loss per step; DDP's curve drawn thick underneath so that a case off it shows."""
    ok = _ok(records)
    if not ok:
        return None
    data = []
    if reference is not None and reference.ok:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": f"DDP reference ({reference.case_id})",
                "x": [s.step for s in reference.steps],
                "y": reference.losses(),
                "line": {"width": 8, "color": "rgba(120,120,120,0.35)"},
            }
        )
    data += [
        {"type": "scatter", "mode": "lines+markers", "name": r.case_id, "x": [s.step for s in r.steps], "y": r.losses()}
        for r in ok
        if r is not reference
    ]
    return {"data": data, "layout": _layout("Loss per step, on DDP's curve", xaxis={"title": {"text": "step"}})}


def comm_chart(records: list[CaseRecord]) -> Spec | None:
    """Communication per step per rank, measured next to what the implementation's formula expects."""
    rows = [(r.case_id, r.comms) for r in _ok(records) if r.comms is not None]
    if not rows:
        return None
    ids = [case_id for case_id, _ in rows]
    return {
        "data": [
            {"type": "bar", "name": "measured", "x": ids, "y": [c.bytes_per_step / MIB for _, c in rows if c]},
            {
                "type": "bar",
                "name": "expected",
                "x": ids,
                "y": [
                    c.expected_elements * c.bytes_per_step / c.elements_per_step / MIB if c.elements_per_step else 0
                    for _, c in rows
                    if c
                ],
            },
        ],
        "layout": _layout("Communication per step per rank (MiB): measured vs theory", barmode="group"),
    }


def energy_chart(records: list[CaseRecord]) -> Spec | None:
    """Joules per step where nvml measured energy (GPU runs); nothing on CPU."""
    rows = [(r.case_id, r.energy.energy_per_step_j) for r in _ok(records) if r.energy and r.energy.energy_per_step_j]
    if not rows:
        return None
    return {
        "data": [{"type": "bar", "x": [c for c, _ in rows], "y": [j for _, j in rows], "name": "J/step"}],
        "layout": _layout("Energy per step (J, all GPUs of the case, nvml)"),
    }


def trend_chart(series: dict[str, list[Point]]) -> Spec | None:
    """Median step time per case over runs; runs that regressed against the one before are marked."""
    if not series:
        return None
    data: list[dict[str, Any]] = []
    for case_id, points in series.items():
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": case_id,
                "x": [p.label for p in points],
                "y": [p.step_time_median_s * 1e3 for p in points],
            }
        )
        bad = [p for p in points if p.regressed]
        if bad:
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": f"{case_id}: regressed",
                    "x": [p.label for p in bad],
                    "y": [p.step_time_median_s * 1e3 for p in bad],
                    "text": [", ".join(p.regressed) for p in bad],
                    "marker": {"symbol": "x", "size": 14, "color": "red"},
                }
            )
    return {
        "data": data,
        "layout": _layout("History: median step time (ms) per run on this machine; x marks a regression"),
    }


def step_timeline_chart(record: CaseRecord) -> Spec | None:
    """One case's step times in order, warm-up steps apart: drift and outliers over the run."""
    if not record.steps:
        return None
    warm = [s for s in record.steps if s.warmup]
    timed = [s for s in record.steps if not s.warmup]
    data = [
        {"type": "scatter", "mode": "markers", "name": name, "x": [s.step for s in group],
         "y": [s.step_time_s * 1e3 for s in group]}
        for name, group in (("warm-up", warm), ("timed", timed))
        if group
    ]  # fmt: skip
    return {"data": data, "layout": _layout("Step time per step (ms)", xaxis={"title": {"text": "step"}})}


def memory_timeline_chart(record: CaseRecord) -> Spec | None:
    """GPU memory over the run as nvml sampled it, per rank (GPU runs only)."""
    ranks = [(i, n) for i, n in enumerate(record.energy.per_rank if record.energy else []) if n.timeline]
    if not ranks:
        return None
    data = [
        {"type": "scatter", "mode": "lines", "name": f"rank {i}", "x": [row[0] for row in n.timeline],
         "y": [row[1] / MIB for row in n.timeline]}
        for i, n in ranks
    ]  # fmt: skip
    return {"data": data, "layout": _layout("GPU memory used over the run (MiB, nvml)", xaxis={"title": {"text": "s"}})}


def rank_memory_chart(record: CaseRecord) -> Spec | None:
    """Peak memory of each rank (allocator on GPU, resident set on CPU)."""
    per_rank = record.memory.per_rank if record.memory else []
    if not per_rank:
        return None
    return {
        "data": [
            {"type": "bar", "x": [f"rank {i}" for i in range(len(per_rank))], "y": [m.bytes / MIB for m in per_rank]}
        ],
        "layout": _layout(f"Peak memory per rank (MiB, {record.memory.kind if record.memory else ''})"),
    }
