"""Render a run's results into a self-contained report directory (jinja2, autoescaped, no network).

The directory holds ``index.html`` (the run at a glance: the setup matrix, what changed since the earlier
runs, every case in a sortable and filterable table, the charts), ``cases/<case id>.html`` (one page per
case, everything recorded about it), ``tune.html`` for a run ``zbench tune --verify`` made (its search and
predictions against what the run measured), and the two scripts the pages load from beside them: the charting
library (``plotly-<version>.min.js``, 4.6 MB, written once per directory and version) and
``zbench-report.js`` (tables and charts). Charts travel as JSON in the pages (``charts``), drawn by the
script, so a page never inlines the library and a file:// browser needs nothing else.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from zbench.atomic import atomic_write_bytes
from zbench.plan.simulate.run_file import load_simulation
from zbench.report import charts
from zbench.report.baseline import MEMORY_METRICS, TIME_METRICS, baseline_for
from zbench.report.history import case_history, runs_like
from zbench.report.matrix import build as build_matrix
from zbench.report.tune_page import TUNE_PAGE, load_tune
from zbench.results.formatting import fmt_bytes, fmt_money, fmt_ratio, fmt_seconds, status_text, verdict_text
from zbench.results.record import CaseRecord
from zbench.results.run_info import RunInfo
from zbench.results.store import RunDir, cases_read_once
from zbench.values import STATUSES
from zbench.verdicts.equivalence import BOUNDS

SCRIPT = "zbench-report.js"
CASE_PAGES = "cases"


def _chart_json(spec: charts.Spec | None) -> Markup | None:
    """A spec as JSON safe inside a ``<script type="application/json">``: no ``<``, ``>`` or ``&`` left raw,
    so a case name holding ``</script>`` cannot close the element."""
    if spec is None:
        return None
    text = json.dumps(spec, separators=(",", ":"), allow_nan=False, default=str)
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("zbench.report", "templates"),
    autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters.update(
    bytes=fmt_bytes, seconds=fmt_seconds, ratio=fmt_ratio, status=status_text, money=fmt_money,
    verdict=verdict_text, chart=_chart_json,
)  # fmt: skip
_ENV.globals.update(fmt_seconds=fmt_seconds, fmt_bytes=fmt_bytes)


def _finding_value(value: object, metric: str) -> str:
    """A finding's baseline or candidate figure in its metric's unit."""
    if not isinstance(value, int | float):
        return str(value)
    if metric in TIME_METRICS:
        return fmt_ratio(value) if metric == "step_time_vs_ddp" else fmt_seconds(value)
    return fmt_bytes(value) if metric in MEMORY_METRICS else f"{value:.4g}"


def _counted(names: list[str]) -> str:
    """``["H100", "H100", "A100"]`` as ``2 x H100, A100``: eight GPUs on one line."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} x {name}" if n > 1 else name for name, n in counts.items())


_ENV.filters.update(finding_value=_finding_value, counted=_counted)


def case_page(case_id: str) -> str:
    """Where a case's page is, relative to the report directory (case ids are filesystem-safe)."""
    return f"{CASE_PAGES}/{case_id}.html"


def _shipped_plotly(report_dir: Path) -> str:
    """The charting library's file name in ``report_dir``, written there unless this version already is."""
    import plotly
    from plotly.offline import get_plotlyjs

    name = f"plotly-{plotly.__version__}.min.js"
    if not (report_dir / name).is_file():
        atomic_write_bytes(report_dir / name, get_plotlyjs().encode())
    return name


def _shipped_script(report_dir: Path) -> str:
    text = resources.files("zbench.report").joinpath("static", SCRIPT).read_bytes()
    target = report_dir / SCRIPT
    if not target.is_file() or target.read_bytes() != text:
        atomic_write_bytes(target, text)
    return SCRIPT


def _reference_of(records: list[CaseRecord]) -> dict[str, CaseRecord]:
    """Each case's DDP reference record, by case id (the reference named by its equivalence verdict)."""
    by_id = {r.case_id: r for r in records}
    out = {}
    for r in records:
        ref = r.equivalence.reference_case if r.equivalence else None
        if ref in by_id:
            out[r.case_id] = by_id[ref]
    return out


def render(
    run: RunDir, report_dir: Path, *, results_root: Path | None = None, price_per_gpu_hour: float | None = None
) -> Path:
    """Write ``report_dir/index.html`` and a page per case for ``run`` (trends and changes when ``results_root``
    holds earlier runs of its suite on its machine); costs at ``price_per_gpu_hour`` when given, else at the
    suite's price when it names one."""
    with cases_read_once():
        return _render(run, Path(report_dir), results_root, price_per_gpu_hour)


def _render(run: RunDir, report_dir: Path, results_root: Path | None, price_per_gpu_hour: float | None) -> Path:
    info = run.info()
    records = run.cases()
    order = {c: i for i, c in enumerate(info.case_order)}
    records.sort(key=lambda r: order.get(r.case_id, len(order)))
    runs = runs_like(results_root, run) if results_root is not None else [run]
    series = case_history(runs) if len(runs) > 1 else {}
    baseline = baseline_for(run, results_root)
    references = _reference_of(records)
    common: dict[str, Any] = {
        "run": info,
        "plotly_js": _shipped_plotly(report_dir),
        "script": _shipped_script(report_dir),
        "price": price_per_gpu_hour,
        "show_cost": price_per_gpu_hour is not None or any(r.config.price_per_gpu_hour for r in records),
        "baseline": baseline,
        "time_metrics": TIME_METRICS,
        "memory_metrics": MEMORY_METRICS,
        "case_page": case_page,
    }
    first_reference = next(iter(references.values()), None)
    page = _ENV.get_template("index.html.j2").render(
        **common,
        root="",
        records=records,
        matrix=build_matrix(records),
        bounds=BOUNDS,
        counts={s: sum(r.status == s for r in records) for s in STATUSES},
        not_equivalent=sum(1 for r in records if r.ok and not r.equivalent),
        charts=[
            charts.by_setup_chart(records, "time"),
            charts.by_setup_chart(records, "memory"),
            charts.step_time_distribution_chart(records),
            charts.model_state_chart(records),
            charts.loss_chart(records, first_reference),
            charts.comm_chart(records),
            charts.energy_chart(records),
        ],
        trend=charts.trend_chart(series),
        history_runs=len(runs),
        regressions=[(case_id, p) for case_id, points in series.items() for p in points if p.regressed],
        simulation=load_simulation(run),
        tune_page=TUNE_PAGE if (tune := load_tune(run)) else None,
    )
    _write_case_pages(run, info, records, references, report_dir, common)
    if tune is not None:
        tune_html = _ENV.get_template("tune.html.j2").render(**common, root="", tune=tune, charts=[])
        atomic_write_bytes(report_dir / TUNE_PAGE, tune_html.encode())
    out = report_dir / "index.html"
    atomic_write_bytes(out, page.encode())
    return out


def _write_case_pages(
    run: RunDir,
    info: RunInfo,
    records: list[CaseRecord],
    references: dict[str, CaseRecord],
    report_dir: Path,
    common: dict[str, Any],
) -> None:
    template = _ENV.get_template("case.html.j2")
    (report_dir / CASE_PAGES).mkdir(parents=True, exist_ok=True)
    run_dir = run.path.resolve()
    for i, r in enumerate(records):
        reference = references.get(r.case_id)
        traces = [(run_dir / t).as_uri() for t in getattr(r, "profile_traces", [])]
        page = template.render(
            **common,
            root="../",
            r=r,
            config=r.config.to_json_dict(),
            reference=reference,
            previous=records[i - 1] if i > 0 else None,
            next=records[i + 1] if i + 1 < len(records) else None,
            traces=traces,
            record_uri=run.case_path(r.case_id).resolve().as_uri(),
            charts=[
                charts.loss_chart([r], reference if reference is not r else None),
                charts.step_timeline_chart(r),
                charts.rank_memory_chart(r),
                charts.memory_timeline_chart(r),
            ],
        )
        atomic_write_bytes(report_dir / case_page(r.case_id), page.encode(), durable=False)
