"""Terminal output while a suite runs: a progress bar with an ETA on a terminal, a heartbeat line off one, a summary.

Off a terminal (CI logs, pipes) every case prints a line when it starts and
ends, and a heartbeat (``[5/24] case: step 12/30, 340 s``) at least every
``HEARTBEAT_S`` seconds while it runs, so a long case never looks hung.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from zbench.cases.case import Case
from zbench.results.formatting import fmt_bytes, fmt_rate, fmt_ratio, fmt_seconds, status_text, verdict_text
from zbench.results.record import CaseRecord

#: Seconds between heartbeat lines off a terminal (``ZBENCH_HEARTBEAT_S`` overrides it).
HEARTBEAT_S = 30.0


def make_console(*, stderr: bool) -> Console:
    """Off a terminal (CI logs, pipes) tables and lines are not squeezed into 80 columns."""
    console = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console = Console(stderr=stderr, highlight=False, soft_wrap=True, width=200)
    return console


def stderr_console() -> Console:
    """Progress and summaries go to stderr so stdout stays clean for --json."""
    return make_console(stderr=True)


class Progress:
    """Progress for a suite run. ``quiet`` prints nothing (``--json`` keeps stdout for the JSON)."""

    def __init__(self, console: Console | None = None, *, quiet: bool = False) -> None:
        self.console = console or stderr_console()
        self.quiet = quiet
        self.total = 0
        self.heartbeat_s = float(os.environ.get("ZBENCH_HEARTBEAT_S", HEARTBEAT_S))
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._last_beat = 0.0

    def _print(self, text: str) -> None:
        if not self.quiet:
            (self._bar.console if self._bar is not None else self.console).print(text)

    def start(self, run_id: str, path: Path, total: int) -> None:
        self.total = total
        self._print(f"run [bold]{run_id}[/]: {total} cases -> {escape(str(path))}")
        if not self.quiet and self.console.is_terminal:
            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._task = self._bar.add_task("starting", total=total)
            self._bar.start()

    def _prefix(self, index: int, case: Case) -> str:
        return f"[{index}/{self.total}] {case.case_id}"

    def case_started(self, index: int, case: Case) -> None:
        self._last_beat = time.monotonic()
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=escape(f"{self._prefix(index, case)}: launching"))
        else:
            self._print(escape(f"{self._prefix(index, case)}: running on {case.world_size} {case.device} ranks ..."))

    def case_update(self, index: int, case: Case, what: str, elapsed: float) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=escape(f"{self._prefix(index, case)}: {what}, {elapsed:.0f} s"))
        elif time.monotonic() - self._last_beat >= self.heartbeat_s:
            self._last_beat = time.monotonic()
            self._print(escape(f"{self._prefix(index, case)}: {what}, {elapsed:.0f} s"))

    def case_done(self, index: int, case: Case, record: CaseRecord) -> None:
        line = escape(f"{self._prefix(index, case)}: {status_text(record)}")
        if record.ok:
            line += escape(
                f", {fmt_seconds(record.step_time_median_s)}/step, ratio {fmt_ratio(record.ratio_to_ddp)}, "
                f"{verdict_text(record)}, {record.wall_s or 0:.1f} s"
            )
            if record.warnings:
                line += escape("; WARNING: " + "; ".join(record.warnings))
        elif record.status != "skipped":
            line = f"[red]{line}[/]"
        self._print(line)
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task)

    def note(self, text: str) -> None:
        self._print(escape(text))

    def case_reused(self, index: int, case: Case, record: CaseRecord) -> None:
        self._print(escape(f"{self._prefix(index, case)}: already stored ({record.status}), not run again"))
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task)

    def summary(self, records: list[CaseRecord]) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if not self.quiet:
            self.console.print(summary_table(records))


def summary_table(records: list[CaseRecord]) -> Table:
    table = Table(title="zbench results")
    table.add_column("case", no_wrap=True)
    for col in ("status", "step (median)", "ratio to DDP", "tokens/s", "peak memory", "model state", "vs DDP"):
        table.add_column(col)
    for r in records:
        row = r.summary_row()
        status = status_text(r)
        cells = (
            r.case_id,
            status if len(status) <= 90 else status[:87] + "...",
            fmt_seconds(row.step_time_median_s),
            fmt_ratio(row.ratio_to_ddp),
            fmt_rate(row.tokens_per_s),
            fmt_bytes(row.peak_memory_bytes),
            fmt_bytes(row.model_state_bytes),
            verdict_text(r),
        )
        table.add_row(*(Text(c) for c in cells))
    return table
