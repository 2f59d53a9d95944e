"""Runs over time: per case, the median step time and peak memory of each run of a suite on one machine.

Each point is checked against the previous run with the same rules as
``zbench check`` so that trends in the report mark the nights that regressed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zbench.results.record import CaseRecord
from zbench.results.store import RunDir, run_dirs
from zbench.verdicts.regress import Thresholds, case_findings, same_suite_and_machine, thresholds_for


@dataclass
class Point:
    run_id: str
    label: str  # when and which commit
    step_time_median_s: float
    peak_bytes: int
    regressed: list[str]  # metrics that regressed against the previous run


def runs_like(results: Path, run: RunDir) -> list[RunDir]:
    """Every run of the same suite on the same machine as ``run``, oldest first."""
    info = run.info()
    same = [r for r in run_dirs(results) if same_suite_and_machine(r.info(), info)]
    return sorted(same, key=lambda r: r.info().started_at)


def _label(run: RunDir) -> str:
    info = run.info()
    sha = (info.git_sha or "")[:7]
    return f"{(info.started_at or run.run_id)[:16]} {sha}".strip()


def case_history(runs: list[RunDir], thresholds: Thresholds | None = None) -> dict[str, list[Point]]:
    """``{case_id: [Point, ...]}`` over ``runs``; only ``ok`` cases become points."""
    series: dict[str, list[Point]] = {}
    previous: dict[str, CaseRecord] = {}
    for run in runs:
        t = thresholds or thresholds_for(run)
        for case in run.cases():
            if not case.ok or case.step_time_median_s is None or case.peak_bytes is None:
                continue
            before = previous.get(case.case_id)
            findings = case_findings([before], case, t) if before is not None else []
            regressed = [f.metric for f in findings if f.kind == "regression"]
            series.setdefault(case.case_id, []).append(
                Point(run.run_id, _label(run), case.step_time_median_s, case.peak_bytes, regressed)
            )
            previous[case.case_id] = case
    return series
