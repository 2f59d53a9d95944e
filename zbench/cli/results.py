"""Looking after stored results: ``zbench gc`` (prune old runs) and ``zbench export`` (CSV, Parquet, TensorBoard)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from zbench.cli.options import ResultsArg, ResultsOpt, results_dir, stderr
from zbench.errors import UsageError

FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        metavar="csv|parquet|tensorboard",
        help="csv or parquet: two tidy tables, cases.<ext> (one row per run and case) and steps.<ext> (one "
        "row per run, case and step); tensorboard: event files, one TensorBoard run per case "
        "(<out>/<run-id>/<case-id>). parquet and tensorboard need the 'export' extra.",
    ),
]


def gc_cmd(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    keep: Annotated[int, typer.Option(min=1, help="Runs of each suite to keep (the newest).")] = 10,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
) -> None:
    """Delete old runs: keep the newest --keep runs of each suite under RESULTS; a run being written is kept."""
    from zbench.results import gc
    from zbench.results.formatting import fmt_bytes

    root = results_dir(results_arg, results)
    if not root.is_dir():
        raise UsageError(f"{root}: not a results directory")
    removed = gc.prune(root, keep=keep, dry_run=dry_run)
    err = stderr()
    for run, size in removed:
        err.print(Text(f"{'would remove' if dry_run else 'removed'} {run.path} ({fmt_bytes(size)})"))
    total = sum(size for _, size in removed)
    err.print(
        Text(
            f"{len(removed)} run(s), {fmt_bytes(total)} {'to free' if dry_run else 'freed'}; "
            f"kept the newest {keep} of each suite"
        )
    )


def export_cmd(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    fmt: FormatOpt = "csv",
    out: Annotated[Path, typer.Option("--out", help="Directory the export is written to.")] = Path("export"),
) -> None:
    """Export every run under RESULTS (or one run's directory) as CSV, Parquet or TensorBoard event files."""
    from zbench.results.export import FORMATS, export

    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    root = results_dir(results_arg, results)
    err = stderr()
    paths = export(root, out, fmt, progress=lambda line: err.print(Text(line)))
    err.print(Text(f"exported {len(paths)} {'runs' if fmt == 'tensorboard' else 'tables'} to {out}"))
