"""Plotly figures for the report, returned as HTML fragments (the plotly.js library is inlined once by the page)."""

from __future__ import annotations

import plotly.graph_objects as go

from zbench.history import Point
from zbench.record import CaseRecord

LAYOUT = dict(template="plotly_white", height=380, margin=dict(l=60, r=20, t=50, b=120), legend=dict(orientation="h"))


def _fragment(fig: go.Figure) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def _ms(seconds: float | None) -> float:
    return 0.0 if seconds is None else seconds * 1e3


def _ok(records: list[CaseRecord]) -> list[CaseRecord]:
    return [r for r in records if r.ok]


def step_time_chart(records: list[CaseRecord]) -> str:
    ok = _ok(records)
    stats = [r.summary for r in ok]
    fig = go.Figure(
        go.Bar(
            x=[r.case_id for r in ok],
            y=[_ms(s.step_time_median_s) for s in stats],
            name="median step time",
            error_y=dict(
                type="data",
                symmetric=False,
                array=[_ms(s.step_time_q3_s) - _ms(s.step_time_median_s) for s in stats],
                arrayminus=[_ms(s.step_time_median_s) - _ms(s.step_time_q1_s) for s in stats],
            ),
            text=[f"{r.ratio_to_ddp:.2f}x DDP" if r.ratio_to_ddp else "" for r in ok],
            textposition="outside",
        )
    )
    fig.update_layout(title="Median step time (ms), whiskers: interquartile range", yaxis_title="ms", **LAYOUT)
    return _fragment(fig)


def memory_chart(records: list[CaseRecord]) -> str:
    ok = [r for r in _ok(records) if r.memory is not None]
    fig = go.Figure(
        go.Bar(
            x=[r.case_id for r in ok],
            y=[r.memory.peak_bytes / 2**20 for r in ok if r.memory],
            text=[r.memory.kind for r in ok if r.memory],
            textposition="outside",
        )
    )
    fig.update_layout(
        title="Peak memory per rank (MiB; CUDA allocator on GPU, resident set on CPU)", yaxis_title="MiB", **LAYOUT
    )
    return _fragment(fig)


def model_state_chart(records: list[CaseRecord]) -> str:
    states = [(r.case_id, r.model_state) for r in _ok(records) if r.model_state is not None]
    ids = [case_id for case_id, _ in states]
    fig = go.Figure(
        [
            go.Bar(x=ids, y=[m.measured_total / 2**20 for _, m in states if m], name="measured"),
            go.Bar(
                x=ids,
                y=[m.expected_total / 2**20 for _, m in states if m],
                name="expected (the ZeRO formula, or the implementation's declared layout)",
            ),
        ]
    )
    fig.update_layout(
        title="Model state per rank (MiB): parameters + gradients + optimizer state + master weights",
        yaxis_title="MiB",
        barmode="group",
        **LAYOUT,
    )
    return _fragment(fig)


def loss_chart(records: list[CaseRecord]) -> str:
    fig = go.Figure(
        [
            go.Scatter(x=[s.step for s in r.steps], y=r.losses(), mode="lines+markers", name=r.case_id)
            for r in _ok(records)
        ]
    )
    fig.update_layout(
        title="Loss per step (every implementation should lie on DDP's curve)",
        xaxis_title="step",
        yaxis_title="loss",
        **LAYOUT,
    )
    return _fragment(fig)


def trend_chart(series: dict[str, list[Point]]) -> str:
    """Median step time per case over runs; runs that regressed against the one before are marked."""
    fig = go.Figure()
    for case_id, points in series.items():
        fig.add_trace(
            go.Scatter(
                x=[p.label for p in points],
                y=[p.step_time_median_s * 1e3 for p in points],
                mode="lines+markers",
                name=case_id,
            )
        )
        bad = [p for p in points if p.regressed]
        if bad:
            fig.add_trace(
                go.Scatter(
                    x=[p.label for p in bad],
                    y=[p.step_time_median_s * 1e3 for p in bad],
                    mode="markers",
                    marker=dict(symbol="x", size=14, color="red"),
                    name=f"{case_id}: regressed",
                    text=[", ".join(p.regressed) for p in bad],
                )
            )
    fig.update_layout(
        title="History: median step time (ms) per run of this suite on this machine; x marks a regression",
        yaxis_title="ms",
        **LAYOUT,
    )
    return _fragment(fig)
