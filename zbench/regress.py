"""Regression verdicts: a candidate run against a baseline run from the same machine.

A time regression needs both a minimum effect (the median step time grew by
more than ``time_pct``) and statistical significance on the per-step samples
(two-sided Mann-Whitney U, p < ``p_value``): machines are noisy, and a gate that
cries wolf gets ignored. A memory regression needs growth above ``memory_pct``
and above an absolute floor. A case that stops being ``ok`` or stops training
like DDP always fails the gate. Improvements are reported the same way.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scipy.stats import mannwhitneyu

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
    p_value: float = 0.01
    """Significance level of the Mann-Whitney U test on per-step times."""


@dataclass
class Finding:
    case_id: str
    metric: str  # step_time | peak_memory | model_state | status | equivalence
    kind: str  # regression | improvement | failure
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

    @property
    def failed(self) -> list[Finding]:
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


def compare_bytes(base: float, cand: float, t: Thresholds) -> tuple[str | None, float]:
    change = (cand / base - 1) * 100 if base else 0.0
    if abs(cand - base) < t.memory_floor_bytes or abs(change) <= t.memory_pct:
        return None, change
    return ("regression" if cand > base else "improvement"), change


def _case_findings(base: CaseRecord | None, cand: CaseRecord, t: Thresholds) -> list[Finding]:
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
    out = []
    kind, change, p = compare_times(base.timed_step_times(), cand.timed_step_times(), t)
    if kind:
        out.append(Finding(case_id, "step_time", kind, base.step_time_median_s, cand.step_time_median_s, change, p))
    for metric, before, after in (
        ("peak_memory", base.peak_bytes, cand.peak_bytes),
        ("model_state", base.model_state_bytes, cand.model_state_bytes),
    ):
        if before is None or after is None:
            continue
        kind, change = compare_bytes(before, after, t)
        if kind:
            out.append(Finding(case_id, metric, kind, before, after, change))
    return out


def check(candidate: RunDir, baseline: RunDir, thresholds: Thresholds) -> CheckResult:
    """Compare every candidate case with the baseline case of the same configuration."""
    result = CheckResult(candidate.run_id, baseline.run_id, thresholds)
    base_cases = {c.case_id: c for c in baseline.cases()}
    for cand in candidate.cases():
        if cand.status == "skipped":
            continue
        base = base_cases.get(cand.case_id)
        if base is None:
            result.unmatched.append(cand.case_id)
        else:
            result.compared += 1
        result.findings += _case_findings(base, cand, thresholds)
    return result


def thresholds_for(run: RunDir, **overrides: float | None) -> Thresholds:
    """The suite's own thresholds (its ``regression:`` block), overridden by command-line flags."""
    values = {
        **asdict(Thresholds()),
        **run.info().suite.regression,
        **{k: v for k, v in overrides.items() if v is not None},
    }
    return Thresholds(**values)


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
