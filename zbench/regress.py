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

from scipy.stats import mannwhitneyu

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

    def as_json(self) -> dict:
        return {"verdict": self.verdict, "candidate": self.candidate, "baseline": self.baseline,
                "thresholds": asdict(self.thresholds), "compared_cases": self.compared,
                "unmatched_cases": self.unmatched, "findings": [asdict(f) for f in self.findings]}


def machine_fingerprint(run_info: dict) -> str:
    """Host, CPUs and GPUs: baselines only count on the machine that made them."""
    env = run_info.get("environment") or {}
    key = "|".join(str(env.get(k)) for k in ("host", "cpu_count", "gpus"))
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def timed_samples(case: dict) -> list[float]:
    return [s["step_time_s"] for s in case.get("steps") or [] if not s.get("warmup")]


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


def _case_findings(case_id: str, base: dict, cand: dict, t: Thresholds) -> list[Finding]:
    if cand["status"] != "ok":
        return [Finding(case_id, "status", "failure", base["status"], cand["status"], detail=cand.get("error") or "")]
    eq = cand.get("equivalence") or {}
    if not eq.get("equivalent"):
        return [Finding(case_id, "equivalence", "failure", "equivalent", "not equivalent", detail=eq.get("reason", ""))]
    if base["status"] != "ok":
        return []
    out = []
    kind, change, p = compare_times(timed_samples(base), timed_samples(cand), t)
    if kind:
        out.append(Finding(case_id, "step_time", kind, base["summary"]["step_time_median_s"],
                           cand["summary"]["step_time_median_s"], change, p))
    for metric, get in (("peak_memory", lambda c: c["memory"]["peak_bytes"]),
                        ("model_state", lambda c: c["model_state"]["measured_total"])):
        kind, change = compare_bytes(get(base), get(cand), t)
        if kind:
            out.append(Finding(case_id, metric, kind, get(base), get(cand), change))
    return out


def check(candidate: RunDir, baseline: RunDir, thresholds: Thresholds) -> CheckResult:
    """Compare every candidate case with the baseline case of the same configuration."""
    result = CheckResult(candidate.run_id, baseline.run_id, thresholds)
    base_cases = {c["case_id"]: c for c in baseline.cases()}
    for cand in candidate.cases():
        if cand["status"] == "skipped":
            continue
        base = base_cases.get(cand["case_id"])
        if base is None:
            result.unmatched.append(cand["case_id"])
            if cand["status"] != "ok" or not (cand.get("equivalence") or {}).get("equivalent"):
                result.findings += _case_findings(cand["case_id"], {"status": "absent"}, cand, thresholds)
            continue
        result.compared += 1
        result.findings += _case_findings(cand["case_id"], base, cand, thresholds)
    return result


def thresholds_for(run: RunDir, **overrides: float | None) -> Thresholds:
    """The suite's own thresholds (its ``regression:`` block), overridden by command-line flags."""
    from_suite = ((run.run_info().get("suite") or {}).get("config") or {}).get("regression") or {}
    values = {**asdict(Thresholds()), **from_suite, **{k: v for k, v in overrides.items() if v is not None}}
    return Thresholds(**values)


def latest_baseline(results, candidate: RunDir) -> RunDir | None:
    """The newest earlier run of the same suite on the same machine."""
    info = candidate.run_info()
    fp, name, started = machine_fingerprint(info), (info.get("suite") or {}).get("name"), info.get("started_at", "")
    runs = [r for r in run_dirs(results) if r.path != candidate.path]
    same = [r for r in runs if machine_fingerprint(r.run_info()) == fp
            and (r.run_info().get("suite") or {}).get("name") == name and r.run_info().get("started_at", "") <= started]
    return max(same, key=lambda r: r.run_info().get("started_at", ""), default=None)
