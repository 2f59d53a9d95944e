"""Runs over time: per case, the median step time and peak memory of each run of a suite on one machine.

Each point is checked against the previous run with the same rules as
``zbench check`` so that trends in the report mark the nights that regressed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zbench.record import CaseRecord
from zbench.regress import Thresholds, compare_bytes, compare_times, same_suite_and_machine, thresholds_for
from zbench.store import RunDir, run_dirs


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
            regressed = []
            before = previous.get(case.case_id)
            if before is not None and before.peak_bytes is not None:
                if compare_times(before.timed_step_times(), case.timed_step_times(), t)[0] == "regression":
                    regressed.append("step_time")
                if compare_bytes(before.peak_bytes, case.peak_bytes, t)[0] == "regression":
                    regressed.append("peak_memory")
            series.setdefault(case.case_id, []).append(
                Point(run.run_id, _label(run), case.step_time_median_s, case.peak_bytes, regressed)
            )
            previous[case.case_id] = case
    return series
