"""Regression verdicts: a candidate run against a baseline run from the same machine.

A machine's speed drifts between runs (other jobs, a shared CI runner: an
unchanged rerun once measured +72%), so an implementation is judged by its step
time *relative to DDP's*, measured in the same run: the paired rounds of
``zbench.paired`` time one step of the case and one of a DDP copy of its
model back to back, and the gate compares the per-round ratios of the two runs.
The DDP reference's own absolute time is the machine's drift: it is reported
(``drift``), never gated. Cases without paired rounds fall back to absolute
step times and say so.

Either way a time regression needs both a minimum effect (the median grew by
more than ``time_pct``) and significance on the samples (two-sided
Mann-Whitney U, p < ``p_value``). A memory regression needs growth above
``memory_pct`` and above an absolute floor. A case that stops being ``ok`` or
stops training like DDP always fails the gate. Improvements are reported the
same way. Every finding comes with what differs between the two runs'
environments (versions, commit, the machine's load when each started).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import mannwhitneyu

from zbench.case import REFERENCE
from zbench.record import CaseRecord
from zbench.run_info import RunInfo
from zbench.store import RunDir, run_dirs


@dataclass(frozen=True)
class Thresholds:
    time_pct: float = 5.0
    """Minimum growth of the median step time, in percent, to count as a regression."""
    memory_pct: float = 2.0
    """Minimum growth of peak memory or model-state bytes, in percent."""
    memory_floor_bytes: int = 1 << 20
    """...and in bytes, so that a few KiB on a tiny model is not a regression."""
    rss_floor_bytes: int = 32 << 20
    """The floor for a CPU run's peak memory, which is the process's peak RSS: it moves by ~10 MB between
    unchanged runs (malloc arenas, thread stacks, lazily loaded libraries; +8.6 MB, 2.6% of tiny's 346 MB,
    in one such pair), where device allocator peaks and model-state bytes repeat to the byte."""
    p_value: float = 0.01
    """Significance level of the Mann-Whitney U test on per-step times."""


@dataclass
class Finding:
    case_id: str
    metric: str  # step_time_vs_ddp | step_time | peak_memory | model_state | status | equivalence
    kind: str  # regression | improvement | failure | drift (the reference's own time: reported, never gated)
    baseline: float | str | None
    candidate: float | str | None
    change_pct: float | None = None
    p_value: float | None = None
    detail: str = ""


@dataclass
class CheckResult:
    candidate: str
    baseline: str
    thresholds: Thresholds
    findings: list[Finding] = field(default_factory=list)
    compared: int = 0
    unmatched: list[str] = field(default_factory=list)
    environment_changes: dict[str, tuple[object, object]] = field(default_factory=dict)
    """``{field: (baseline, candidate)}`` for every environment field that differs between the two runs."""

    @property
    def failed(self) -> list[Finding]:
        """Regressions and failures; improvements and the reference's drift are reported only."""
        return [f for f in self.findings if f.kind in ("regression", "failure")]

    @property
    def verdict(self) -> str:
        return "fail" if self.failed else "pass"

    def as_json(self) -> dict[str, object]:
        return {
            "verdict": self.verdict,
            "candidate": self.candidate,
            "baseline": self.baseline,
            "thresholds": asdict(self.thresholds),
            "compared_cases": self.compared,
            "unmatched_cases": self.unmatched,
            "environment_changes": {k: list(v) for k, v in self.environment_changes.items()},
            "findings": [asdict(f) for f in self.findings],
        }


def machine_fingerprint(info: RunInfo) -> str:
    """Host, CPUs and GPUs: baselines only count on the machine that made them."""
    env = info.environment
    key = "|".join(str(v) for v in (env.host, env.cpu_count, env.gpus))
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def compare_times(base: list[float], cand: list[float], t: Thresholds) -> tuple[str | None, float, float]:
    """(``regression``/``improvement``/``None``, change in percent of the median, p-value)."""
    change = (statistics.median(cand) / statistics.median(base) - 1) * 100
    p = float(mannwhitneyu(base, cand, alternative="two-sided").pvalue) if len(base) > 1 and len(cand) > 1 else 1.0
    if p < t.p_value and change > t.time_pct:
        return "regression", change, p
    if p < t.p_value and change < -t.time_pct:
        return "improvement", change, p
    return None, change, p


def compare_bytes(base: float, cand: float, t: Thresholds, *, floor: int | None = None) -> tuple[str | None, float]:
    change = (cand / base - 1) * 100 if base else 0.0
    if abs(cand - base) < (t.memory_floor_bytes if floor is None else floor) or abs(change) <= t.memory_pct:
        return None, change
    return ("regression" if cand > base else "improvement"), change


def case_findings(base: CaseRecord | None, cand: CaseRecord, t: Thresholds) -> list[Finding]:
    """What changed for one case; ``base`` is ``None`` when the baseline does not have it."""
    case_id = cand.case_id
    if not cand.ok:
        return [
            Finding(
                case_id, "status", "failure", base.status if base else "absent", cand.status, detail=cand.error or ""
            )
        ]
    if not cand.equivalent:
        return [
            Finding(
                case_id,
                "equivalence",
                "failure",
                "equivalent",
                "not equivalent",
                detail=cand.equivalence.reason or "" if cand.equivalence else "not checked",
            )
        ]
    if base is None or not base.ok:
        return []
    out = [f for f in [_time_finding(base, cand, t)] if f is not None]
    rss = "rss" in (base.memory.kind if base.memory else "", cand.memory.kind if cand.memory else "")
    for metric, before, after, floor in (
        (
            "peak_memory",
            base.peak_bytes,
            cand.peak_bytes,
            max(t.memory_floor_bytes, t.rss_floor_bytes) if rss else None,
        ),
        ("model_state", base.model_state_bytes, cand.model_state_bytes, None),
    ):
        if before is None or after is None:
            continue
        kind, change = compare_bytes(before, after, t, floor=floor)
        if kind:
            out.append(Finding(case_id, metric, kind, before, after, change))
    return out


def _paired_ratios(record: CaseRecord) -> list[float]:
    return record.paired.ratios if record.paired else []


def _time_finding(base: CaseRecord, cand: CaseRecord, t: Thresholds) -> Finding | None:
    """The reference's drift, a paired ratio's change, or (without paired rounds) the absolute step time's."""
    case_id, config = cand.case_id, cand.config
    absolute = compare_times(base.timed_step_times(), cand.timed_step_times(), t)
    if config.implementation == REFERENCE:
        if config.noise_twin or absolute[0] is None:
            return None
        return Finding(
            case_id,
            "step_time",
            "drift",
            base.step_time_median_s,
            cand.step_time_median_s,
            absolute[1],
            absolute[2],
            detail="DDP's own step time: the machine's drift between the runs (reported, not gated); "
            "the other cases are judged relative to it",
        )
    before, after = _paired_ratios(base), _paired_ratios(cand)
    if before and after:
        kind, change, p = compare_times(before, after, t)
        if kind is None:
            return None
        return Finding(
            case_id,
            "step_time_vs_ddp",
            kind,
            statistics.median(before),
            statistics.median(after),
            change,
            p,
            detail=f"step time over DDP's, {len(before)} and {len(after)} paired rounds; "
            f"absolute median {absolute[1]:+.1f}%",
        )
    kind, change, p = absolute
    if kind is None:
        return None
    missing = " and ".join(name for name, r in (("baseline", before), ("candidate", after)) if not r)
    return Finding(
        case_id,
        "step_time",
        kind,
        base.step_time_median_s,
        cand.step_time_median_s,
        change,
        p,
        detail=f"absolute step times (no paired rounds in the {missing}): the machine's drift is not cancelled",
    )


ENVIRONMENT_FIELDS = ("git_sha", "zbench_version", "torch", "python", "cuda_version", "nccl_version", "gpus")
"""What is compared between the two runs' environments (host and CPUs are equal: baselines are per machine)."""


def environment_changes(base: RunInfo, cand: RunInfo) -> dict[str, tuple[object, object]]:
    """Fields that differ, plus the load average at each run's start whenever both were recorded."""
    a, b = base.environment, cand.environment
    changes: dict[str, tuple[object, object]] = {
        name: (getattr(a, name), getattr(b, name))
        for name in ENVIRONMENT_FIELDS
        if getattr(a, name) != getattr(b, name)
    }
    if a.load_average_1m is not None and b.load_average_1m is not None:
        changes["load_average_1m"] = (round(a.load_average_1m, 2), round(b.load_average_1m, 2))
    return changes


def check(candidate: RunDir, baseline: RunDir, thresholds: Thresholds) -> CheckResult:
    """Compare every candidate case with the baseline case of the same configuration."""
    result = CheckResult(candidate.run_id, baseline.run_id, thresholds)
    result.environment_changes = environment_changes(baseline.info(), candidate.info())
    base_cases = {c.case_id: c for c in baseline.cases()}
    for cand in candidate.cases():
        if cand.status == "skipped":
            continue
        base = base_cases.get(cand.case_id)
        if base is None:
            result.unmatched.append(cand.case_id)
        else:
            result.compared += 1
        result.findings += case_findings(base, cand, thresholds)
    return result


def thresholds_from(regression: Mapping[str, Any], **overrides: float | None) -> Thresholds:
    """A suite's ``regression:`` block over the defaults, overridden by command-line flags."""
    values = {**asdict(Thresholds()), **regression, **{k: v for k, v in overrides.items() if v is not None}}
    return Thresholds(**values)


def thresholds_for(run: RunDir, **overrides: float | None) -> Thresholds:
    """The thresholds of the suite ``run`` ran (as stored with it), overridden by command-line flags."""
    return thresholds_from(run.info().suite.regression, **overrides)


def same_suite_and_machine(a: RunInfo, b: RunInfo) -> bool:
    return a.suite.name == b.suite.name and machine_fingerprint(a) == machine_fingerprint(b)


def latest_baseline(results: Path, candidate: RunDir) -> RunDir | None:
    """The newest earlier run of the same suite on the same machine."""
    info = candidate.info()
    same = [
        r
        for r in run_dirs(results)
        if r.path != candidate.path
        and same_suite_and_machine(r.info(), info)
        and r.info().started_at <= info.started_at
    ]
    return max(same, key=lambda r: r.info().started_at, default=None)
