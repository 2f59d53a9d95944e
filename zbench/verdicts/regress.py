"""Regression verdicts: a candidate run against a baseline run from the same machine.

A machine's speed drifts between runs (other jobs, a shared CI runner: an
unchanged rerun once measured +72%), so an implementation is judged by its step
time *relative to DDP's*, measured in the same run: the paired rounds of
``zbench.rank.paired`` time one step of the case and one of a DDP copy of its
model back to back, and the gate compares the per-round ratios of the two runs.
The DDP reference's own absolute time is the machine's drift: it is reported
(``drift``), never gated. Cases without paired rounds fall back to absolute
step times and say so.

The ratio still moves with the load for engines whose communication differs
from DDP's (zero2's grew ~10% beside busy processes on a 2-core machine), so
the baseline is several earlier runs, not one: how far their medians stray from
each other is noise that no round-level test sees, and it widens that case's
allowance (``spread_factor`` times the largest stray, at least ``time_pct``).

Either way a time regression needs both a minimum effect (the median grew by
more than the allowance) and significance on the samples (two-sided
Mann-Whitney U against the baseline runs' pooled samples, p < ``p_value``).
Memory does not drift with load, so it is compared with the newest baseline
run: a regression needs growth above ``memory_pct`` and an absolute floor. A case that stops being ``ok`` or
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

from zbench.cases.case import REFERENCE
from zbench.results.record import CaseRecord
from zbench.results.run_info import RunInfo
from zbench.results.store import RunDir, run_dirs


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
    baseline_runs: int = 5
    """How many earlier runs of the suite on the machine make the baseline (``--baseline latest``)."""
    spread_factor: float = 2.0
    """With 3 or more baseline runs, a case's time allowance is at least this times the largest relative
    distance of one baseline run's median from the baseline's median (the load's effect on that engine)."""


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
    baselines: list[str]
    thresholds: Thresholds
    findings: list[Finding] = field(default_factory=list)
    compared: int = 0
    unmatched: list[str] = field(default_factory=list)
    environment_changes: dict[str, tuple[object, object]] = field(default_factory=dict)
    """``{field: (baseline, candidate)}`` for every environment field that differs between the two runs."""
    time_allowance_pct: dict[str, float] = field(default_factory=dict)
    """Per compared case, the step-time growth the gate lets pass: the smallest slowdown it can see there."""

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
            "baselines": self.baselines,
            "thresholds": asdict(self.thresholds),
            "compared_cases": self.compared,
            "unmatched_cases": self.unmatched,
            "environment_changes": {k: list(v) for k, v in self.environment_changes.items()},
            "time_allowance_pct": self.time_allowance_pct,
            "findings": [asdict(f) for f in self.findings],
        }


def machine_fingerprint(info: RunInfo) -> str:
    """Host, CPUs and GPUs of every node: baselines only count on the machines that made them.

    Note: a run on one node hashes as it always did (old baselines still match); a multi-node run hashes every
    node in node-rank order, so two nodes never match one, nor the same nodes in another order.
    """
    nodes = info.nodes or [info.environment]
    key = " / ".join("|".join(str(v) for v in (env.host, env.cpu_count, env.gpus)) for env in nodes)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def compare_times(
    base: list[float], cand: list[float], t: Thresholds, *, center: float | None = None, allowance_pct: float = 0.0
) -> tuple[str | None, float, float]:
    """(``regression``/``improvement``/``None``, change in percent of the median, p-value).

    ``center`` is the baseline's median (default: of ``base``; a pooled baseline passes the median of its runs'
    medians); the change must exceed ``allowance_pct`` or ``time_pct``, whichever is larger."""
    center = statistics.median(base) if center is None else center
    change = (statistics.median(cand) / center - 1) * 100
    p = float(mannwhitneyu(base, cand, alternative="two-sided").pvalue) if len(base) > 1 and len(cand) > 1 else 1.0
    allowance = max(t.time_pct, allowance_pct)
    if p < t.p_value and change > allowance:
        return "regression", change, p
    if p < t.p_value and change < -allowance:
        return "improvement", change, p
    return None, change, p


@dataclass(frozen=True)
class RunSpread:
    """One case's samples over several baseline runs: the pooled samples, their center and the between-run stray."""

    pooled: list[float]
    center: float
    """The median of the runs' medians."""
    stray_pct: float | None
    """The largest distance of one run's median from ``center``, in percent; ``None`` with fewer than 3 runs."""
    runs: int

    @classmethod
    def of(cls, per_run: list[list[float]]) -> RunSpread:
        medians = [statistics.median(samples) for samples in per_run]
        center = statistics.median(medians)
        stray = max(abs(m / center - 1) * 100 for m in medians) if len(medians) >= 3 else None
        return cls([x for samples in per_run for x in samples], center, stray, len(medians))

    def allowance_pct(self, t: Thresholds) -> float:
        return max(t.time_pct, t.spread_factor * self.stray_pct) if self.stray_pct is not None else t.time_pct

    def describe(self, t: Thresholds) -> str:
        if self.stray_pct is None:
            return f"{self.runs} baseline run{'s' * (self.runs > 1)}: between-run spread unknown (needs 3)"
        return (
            f"{self.runs} baseline runs, medians within {self.stray_pct:.1f}% of theirs: "
            f"allowance {self.allowance_pct(t):.1f}%"
        )


def judge_times(per_run: list[list[float]], cand: list[float], t: Thresholds) -> tuple[str | None, float, float, str]:
    """``compare_times`` against several baseline runs' samples, plus a sentence on the allowance used."""
    spread = RunSpread.of(per_run)
    kind, change, p = compare_times(spread.pooled, cand, t, center=spread.center, allowance_pct=spread.allowance_pct(t))
    return kind, change, p, spread.describe(t)


def compare_bytes(base: float, cand: float, t: Thresholds, *, floor: int | None = None) -> tuple[str | None, float]:
    change = (cand / base - 1) * 100 if base else 0.0
    if abs(cand - base) < (t.memory_floor_bytes if floor is None else floor) or abs(change) <= t.memory_pct:
        return None, change
    return ("regression" if cand > base else "improvement"), change


def case_findings(bases: list[CaseRecord], cand: CaseRecord, t: Thresholds) -> list[Finding]:
    """What changed for one case against its baseline runs, newest first (empty: the baseline lacks the case)."""
    case_id = cand.case_id
    if not cand.ok:
        status = bases[0].status if bases else "absent"
        return [Finding(case_id, "status", "failure", status, cand.status, detail=cand.error or "")]
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
    bases = [b for b in bases if b.ok]
    if not bases:
        return []
    out = [f for f in [_time_finding(bases, cand, t)] if f is not None]
    newest = bases[0]  # memory does not drift with load: the newest baseline run is the reference
    rss = "rss" in (newest.memory.kind if newest.memory else "", cand.memory.kind if cand.memory else "")
    for metric, before, after, floor in (
        (
            "peak_memory",
            newest.peak_bytes,
            cand.peak_bytes,
            max(t.memory_floor_bytes, t.rss_floor_bytes) if rss else None,
        ),
        ("model_state", newest.model_state_bytes, cand.model_state_bytes, None),
    ):
        if before is None or after is None:
            continue
        kind, change = compare_bytes(before, after, t, floor=floor)
        if kind:
            out.append(Finding(case_id, metric, kind, before, after, change))
    return out


def _paired_ratios(record: CaseRecord) -> list[float]:
    return record.paired.ratios if record.paired else []


@dataclass(frozen=True)
class TimeSamples:
    """What a case's time is judged on: per baseline run and for the candidate, the paired ratios when both
    sides have them (``paired``), else the absolute step times."""

    per_run: list[list[float]]
    candidate: list[float]
    paired: bool


def time_samples(bases: list[CaseRecord], cand: CaseRecord) -> TimeSamples | None:
    """The samples to judge ``cand`` on; ``None`` when a side has none."""
    before = [r for r in (_paired_ratios(b) for b in bases) if r]
    if before and _paired_ratios(cand):
        return TimeSamples(before, _paired_ratios(cand), paired=True)
    times = [b.timed_step_times() for b in bases if b.timed_step_times()]
    return TimeSamples(times, cand.timed_step_times(), paired=False) if times and cand.timed_step_times() else None


def _time_finding(bases: list[CaseRecord], cand: CaseRecord, t: Thresholds) -> Finding | None:
    """The reference's drift, a paired ratio's change, or (without paired rounds) the absolute step time's."""
    samples = time_samples(bases, cand)
    if samples is None:
        return None
    per_run, after = samples.per_run, samples.candidate
    kind, change, p, allowance = judge_times(per_run, after, t)
    base_value = statistics.median(statistics.median(x) for x in per_run)
    if cand.config.implementation == REFERENCE:
        if cand.config.noise_twin or kind is None:
            return None
        return Finding(
            cand.case_id,
            "step_time",
            "drift",
            base_value,
            cand.step_time_median_s,
            change,
            p,
            detail="DDP's own step time: the machine's drift between the runs (reported, not gated); "
            "the other cases are judged relative to it",
        )
    if kind is None:
        return None
    if samples.paired:
        absolute = judge_times(
            [b.timed_step_times() for b in bases if b.timed_step_times()], cand.timed_step_times(), t
        )
        return Finding(
            cand.case_id,
            "step_time_vs_ddp",
            kind,
            base_value,
            statistics.median(after),
            change,
            p,
            detail=f"step time over DDP's, {sum(map(len, per_run))} and {len(after)} paired rounds; {allowance}; "
            f"absolute median {absolute[1]:+.1f}%",
        )
    missing = " and ".join(
        name
        for name, has in (("baseline", any(_paired_ratios(b) for b in bases)), ("candidate", _paired_ratios(cand)))
        if not has
    )
    return Finding(
        cand.case_id,
        "step_time",
        kind,
        base_value,
        cand.step_time_median_s,
        change,
        p,
        detail=f"absolute step times (no paired rounds in the {missing}): the machine's drift is not cancelled; "
        f"{allowance}",
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
    if a.nvml.get("driver") != b.nvml.get("driver"):  # the GPU driver, as nvml read it (absent on CPU)
        changes["driver"] = (a.nvml.get("driver"), b.nvml.get("driver"))
    if a.load_average_1m is not None and b.load_average_1m is not None:
        changes["load_average_1m"] = (round(a.load_average_1m, 2), round(b.load_average_1m, 2))
    return changes


def check(candidate: RunDir, baselines: list[RunDir], thresholds: Thresholds) -> CheckResult:
    """Compare every candidate case with the same configuration's cases in the baseline runs (newest first)."""
    result = CheckResult(candidate.run_id, [b.run_id for b in baselines], thresholds)
    result.environment_changes = environment_changes(baselines[0].info(), candidate.info())
    base_cases: dict[str, list[CaseRecord]] = {}
    for baseline in baselines:
        for case in baseline.cases():
            base_cases.setdefault(case.case_id, []).append(case)
    for cand in candidate.cases():
        if cand.status == "skipped":
            continue
        bases = base_cases.get(cand.case_id, [])
        if not bases:
            result.unmatched.append(cand.case_id)
        else:
            result.compared += 1
        result.findings += case_findings(bases, cand, thresholds)
        samples = time_samples([b for b in bases if b.ok], cand) if cand.ok else None
        if samples and cand.config.implementation != REFERENCE:
            result.time_allowance_pct[cand.case_id] = round(RunSpread.of(samples.per_run).allowance_pct(thresholds), 2)
    return result


def thresholds_from(regression: Mapping[str, Any], **overrides: float | int | None) -> Thresholds:
    """A suite's ``regression:`` block over the defaults, overridden by command-line flags."""
    values = {**asdict(Thresholds()), **regression, **{k: v for k, v in overrides.items() if v is not None}}
    return Thresholds(**values)


def thresholds_for(run: RunDir, **overrides: float | int | None) -> Thresholds:
    """The thresholds of the suite ``run`` ran (as stored with it), overridden by command-line flags."""
    return thresholds_from(run.info().suite.regression, **overrides)


def same_suite_and_machine(a: RunInfo, b: RunInfo) -> bool:
    return a.suite.name == b.suite.name and machine_fingerprint(a) == machine_fingerprint(b)


def latest_baselines(results: Path, candidate: RunDir, count: int) -> list[RunDir]:
    """The newest ``count`` earlier runs of the same suite on the same machine, newest first."""
    info = candidate.info()
    same = [
        r
        for r in run_dirs(results)
        if r.path != candidate.path
        and same_suite_and_machine(r.info(), info)
        and r.info().started_at <= info.started_at
    ]
    return sorted(same, key=lambda r: r.info().started_at, reverse=True)[:count]
