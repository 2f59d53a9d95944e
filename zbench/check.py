"""``zbench check``: pick the candidate and baseline runs, apply ``regress``, print or write the verdict."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from zbench.errors import UsageError
from zbench.formatting import fmt_bytes, fmt_seconds
from zbench.regress import CheckResult, Finding, check, latest_baseline, machine_fingerprint, thresholds_for
from zbench.store import RunDir, latest_run


def _newest(path: Path, what: str) -> RunDir:
    run = latest_run(path) if path.exists() else None
    if run is None:
        raise UsageError(f"{what} {path}: no runs found (expected <dir>/<run-id>/run.json)")
    return run


def run(results: Path, baseline: str, *, time_pct: float | None, memory_pct: float | None) -> CheckResult:
    candidate = _newest(results, "results")
    if baseline == "latest":
        base = latest_baseline(results if (results / candidate.run_id).exists() else results.parent, candidate)
        if base is None:
            raise UsageError(
                f"no baseline for run {candidate.run_id}: no earlier run of the same suite on this "
                "machine; pass --baseline DIR"
            )
    else:
        base = _newest(Path(baseline), "--baseline")
        if machine_fingerprint(base.info()) != machine_fingerprint(candidate.info()):
            host = base.info().environment.host
            raise UsageError(f"--baseline {baseline}: recorded on another machine ({host}); baselines are per machine")
        if base.path == candidate.path:
            raise UsageError(f"--baseline {baseline}: is the candidate run itself")
    return check(candidate, base, thresholds_for(candidate, time_pct=time_pct, memory_pct=memory_pct))


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


def headline(result: CheckResult) -> str:
    t = result.thresholds
    return (
        f"{result.verdict.upper()}: run {result.candidate} vs baseline {result.baseline}: "
        f"{result.compared} cases compared, "
        f"{sum(f.kind == 'regression' for f in result.findings)} regressions, "
        f"{sum(f.kind == 'failure' for f in result.findings)} failures, "
        f"{sum(f.kind == 'improvement' for f in result.findings)} improvements "
        f"(time relative to DDP in the same run > {t.time_pct:g}% and p < {t.p_value:g}; "
        f"memory > {t.memory_pct:g}% and > {fmt_bytes(t.memory_floor_bytes)})"
    )


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
    console.print(Text(headline(result), style="red" if result.failed else "green"))


def markdown(result: CheckResult, *, title: str = "zbench check") -> str:
    icon = ":x:" if result.failed else ":white_check_mark:"
    lines = [f"### {icon} {title}", "", headline(result), ""]
    if result.environment_changes:
        lines += [f"Environment, baseline -> candidate: {environment_text(result)}", ""]
    if result.findings:
        lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += [
            "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in _rows(result)
        ]
    return "\n".join(lines) + "\n\n"
