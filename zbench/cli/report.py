"""``zbench report``: the HTML report re-rendered from stored results, optionally with simulated step times."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from zbench.cli.options import ReportOpt, ResultsArg, ResultsOpt, results_dir, stderr
from zbench.errors import UsageError

SimulateOpt = Annotated[
    bool,
    typer.Option(
        "--simulate",
        help="First trace every case of the run on fake tensors and predict its step time with the simulator "
        "(compute from the DDP reference's measured phases, communication alpha-beta at the run's probed "
        "bandwidth); stored as <run>/simulation.json and shown in the report beside the measured times.",
    ),
]
PriceOpt = Annotated[
    float | None,
    typer.Option(
        help="Show each case's cost per step and per million tokens at this price of one GPU (one rank) per "
        "hour, instead of the suite's price_per_gpu_hour.",
    ),
]


def report_cmd(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    report: ReportOpt = Path("reports"),
    simulate: SimulateOpt = False,
    price_per_gpu_hour: PriceOpt = None,
) -> None:
    """Re-render the HTML report from stored results: the newest run under RESULTS, with trends over earlier runs."""
    from zbench.report import render
    from zbench.results.store import latest_run

    if price_per_gpu_hour is not None and not price_per_gpu_hour > 0:
        raise UsageError(f"--price-per-gpu-hour must be positive, got {price_per_gpu_hour:g}")
    root = results_dir(results_arg, results)
    run = latest_run(root)
    if run is None:
        raise UsageError(f"{root}: no runs found (expected <dir>/<run-id>/run.json)")
    err = stderr()
    if simulate:
        from zbench.plan.simulate.measured import simulate_run

        sim = simulate_run(run, progress=lambda line: err.print(Text(line)))
        worst = f"{sim.worst_abs_error:.0%}" if sim.worst_abs_error is not None else "-"
        median = f"{sim.median_abs_error:.0%}" if sim.median_abs_error is not None else "-"
        err.print(Text(f"simulated {len(sim.predictions)} cases: |error| median {median}, worst {worst}"))
    page = render(run, report, results_root=root, price_per_gpu_hour=price_per_gpu_hour)
    err.print(Text(f"report: {page} (run {run.run_id})"))
