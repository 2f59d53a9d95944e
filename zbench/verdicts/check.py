"""``zbench check``: pick the candidate and baseline runs, apply ``regress``, print or write the verdict."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from zbench.errors import UsageError
from zbench.results.formatting import fmt_bytes, fmt_seconds
from zbench.results.store import RunDir, latest_run
from zbench.verdicts.regress import (
    CheckResult,
    Finding,
    check,
    latest_baselines,
    machine_fingerprint,
    same_suite_and_machine,
    thresholds_for,
)


def _newest(path: Path, what: str) -> RunDir:
    run = latest_run(path) if path.exists() else None
    if run is None:
        raise UsageError(f"{what} {path}: no runs found (expected <dir>/<run-id>/run.json)")
    return run


def run(
    results: Path,
    baselines: list[str],
    *,
    time_pct: float | None,
    memory_pct: float | None,
    baseline_runs: int | None = None,
) -> CheckResult:
    """The newest run under ``results`` against ``baselines``: ``["latest"]`` (the newest earlier runs of its
    suite on this machine), or run directories and results directories (their newest runs of the suite)."""
    candidate = _newest(results, "results")
    t = thresholds_for(candidate, time_pct=time_pct, memory_pct=memory_pct, baseline_runs=baseline_runs)
    if baselines in ([], ["latest"]):
        base = latest_baselines(
            results if (results / candidate.run_id).exists() else results.parent, candidate, t.baseline_runs
        )
        if not base:
            raise UsageError(
                f"no baseline for run {candidate.run_id}: no earlier run of the same suite on this "
                "machine; pass --baseline DIR"
            )
    else:
        base = [run for given in baselines for run in _given_baseline(Path(given), candidate, t.baseline_runs)]
    return check(candidate, base, t)


def _given_baseline(path: Path, candidate: RunDir, count: int) -> list[RunDir]:
    """``--baseline DIR``: one run's directory, or the newest ``count`` runs of the candidate's suite under a
    results directory; refused when recorded on another machine or when it is the candidate itself."""
    runs = latest_baselines(path, candidate, count) or [_newest(path, "--baseline")]  # the latter: to say why
    for run in runs:
        if machine_fingerprint(run.info()) != machine_fingerprint(candidate.info()):
            host = run.info().environment.host
            raise UsageError(f"--baseline {path}: recorded on another machine ({host}); baselines are per machine")
        if run.path.resolve() == candidate.path.resolve():
            raise UsageError(f"--baseline {path}: is the candidate run itself")
        if not same_suite_and_machine(run.info(), candidate.info()):
            suite = run.info().suite.name
            ran = candidate.info().suite.name
            raise UsageError(f"--baseline {path}: a run of suite {suite!r}; the candidate ran {ran!r}")
    return runs


def _value(f: Finding, v: float | str | None) -> str:
    if v is None or isinstance(v, str):
        return str(v)
    if f.metric == "step_time_vs_ddp":
        return f"{v:.3f}x DDP"
    return fmt_seconds(v) if f.metric == "step_time" else fmt_bytes(v)


def _rows(result: CheckResult) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for f in result.findings:
        change = "" if f.change_pct is None else f"{f.change_pct:+.1f}%"
        p = "" if f.p_value is None else f"p={f.p_value:.1e}"
        rows.append(
            (
                f.kind.upper() if f.kind in ("regression", "failure") else f.kind,
                f.case_id,
                f.metric,
                _value(f, f.baseline),
                _value(f, f.candidate),
                " ".join(x for x in (change, p) if x),
                f.detail,
            )
        )
    return rows


HEADER = ("verdict", "case", "metric", "baseline", "candidate", "change", "detail")


def _baselines(result: CheckResult) -> str:
    first, *rest = result.baselines
    return f"baseline {first}" + (f" and {len(rest)} earlier" if rest else "")


def headline(result: CheckResult) -> str:
    t = result.thresholds
    return (
        f"{result.verdict.upper()}: run {result.candidate} vs {_baselines(result)}: "
        f"{result.compared} cases compared, "
        f"{sum(f.kind == 'regression' for f in result.findings)} regressions, "
        f"{sum(f.kind == 'failure' for f in result.findings)} failures, "
        f"{sum(f.kind == 'improvement' for f in result.findings)} improvements "
        f"(time relative to DDP in the same run > {t.time_pct:g}%, or more where the baseline runs spread, "
        f"and p < {t.p_value:g}; "
        f"memory > {t.memory_pct:g}% and > {fmt_bytes(t.memory_floor_bytes)})"
    )


def allowance_text(result: CheckResult) -> str:
    """Each case's time allowance when the baseline runs' spread widened any beyond the threshold."""
    t = result.thresholds.time_pct
    if all(a <= t for a in result.time_allowance_pct.values()):
        return ""
    wide = ", ".join(f"{case} {a:.1f}%" for case, a in result.time_allowance_pct.items() if a > t)
    return f"time allowance widened by the baseline runs' spread (the load moves these engines): {wide}; others {t:g}%"


def environment_text(result: CheckResult) -> str:
    return "; ".join(f"{name} {a} -> {b}" for name, (a, b) in result.environment_changes.items())


def print_text(result: CheckResult, console: Console) -> None:
    if result.findings:
        table = Table()
        for h in HEADER:
            table.add_column(h)
        for row in _rows(result):
            table.add_row(*(Text(c) for c in row))
        console.print(table)
    if result.unmatched:
        console.print(Text(f"not in the baseline (not compared): {', '.join(result.unmatched)}"))
    if result.environment_changes:
        console.print(Text(f"environment, baseline -> candidate: {environment_text(result)}"))
    if allowance_text(result):
        console.print(Text(allowance_text(result)))
    console.print(Text(headline(result), style="red" if result.failed else "green"))


def markdown(result: CheckResult, *, title: str = "zbench check") -> str:
    icon = ":x:" if result.failed else ":white_check_mark:"
    lines = [f"### {icon} {title}", "", headline(result), ""]
    if result.environment_changes:
        lines += [f"Environment, baseline -> candidate: {environment_text(result)}", ""]
    if allowance_text(result):
        lines += [allowance_text(result)[0].upper() + allowance_text(result)[1:], ""]
    if result.findings:
        lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += [
            "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in _rows(result)
        ]
    return "\n".join(lines) + "\n\n"
