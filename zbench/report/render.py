"""Render a run's results into a self-contained report directory (jinja2, autoescaped, no network).

The page loads its charting library from a file beside it (``plotly-<version>.min.js``, 4.6 MB, written once
per directory and version) rather than inlining it: re-rendered reports stay small, and the directory is
still all a browser needs offline from ``file://``.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from markupsafe import Markup

from zbench.atomic import atomic_write_bytes
from zbench.equivalence import BOUNDS
from zbench.formatting import fmt_bytes, fmt_money, fmt_ratio, fmt_seconds, status_text
from zbench.history import case_history, runs_like
from zbench.report import charts
from zbench.simulate.run_file import load_simulation
from zbench.store import RunDir
from zbench.values import STATUSES

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("zbench.report", "templates"),
    autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
    undefined=jinja2.StrictUndefined,
)
_ENV.filters.update(bytes=fmt_bytes, seconds=fmt_seconds, ratio=fmt_ratio, status=status_text, money=fmt_money)


def _shipped_plotly(report_dir: Path) -> str:
    """The charting library's file name in ``report_dir``, written there unless this version already is."""
    import plotly
    from plotly.offline import get_plotlyjs

    name = f"plotly-{plotly.__version__}.min.js"
    if not (Path(report_dir) / name).is_file():
        atomic_write_bytes(Path(report_dir) / name, get_plotlyjs().encode())
    return name


def render(
    run: RunDir, report_dir: Path, *, results_root: Path | None = None, price_per_gpu_hour: float | None = None
) -> Path:
    """Write ``report_dir/index.html`` for ``run`` (with trends when ``results_root`` holds earlier runs); costs at
    ``price_per_gpu_hour`` when given, else at the suite's price when it names one."""
    records = run.cases()
    runs = runs_like(results_root, run) if results_root is not None else [run]
    series = case_history(runs) if len(runs) > 1 else {}
    order = {c: i for i, c in enumerate(run.info().case_order)}
    records.sort(key=lambda r: order.get(r.case_id, len(order)))
    has_ok = any(r.ok for r in records)
    page = _ENV.get_template("index.html.j2").render(
        run=run.info(),
        records=records,
        bounds=BOUNDS,
        counts={s: sum(r.status == s for r in records) for s in STATUSES},
        not_equivalent=sum(1 for r in records if r.ok and not r.equivalent),
        charts=[
            Markup(c(records))
            for c in (charts.step_time_chart, charts.memory_chart, charts.model_state_chart, charts.loss_chart)
        ]
        if has_ok
        else [],
        trend=Markup(charts.trend_chart(series)) if series else "",
        history_runs=len(runs),
        regressions=[(case_id, p) for case_id, points in series.items() for p in points if p.regressed],
        simulation=load_simulation(run),
        plotly_js=_shipped_plotly(report_dir) if has_ok or series else "",
        price=price_per_gpu_hour,
        show_cost=price_per_gpu_hour is not None or any(r.config.price_per_gpu_hour for r in records),
    )
    out = Path(report_dir) / "index.html"
    atomic_write_bytes(out, page.encode())
    return out
