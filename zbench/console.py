"""Terminal output while a suite runs: a line per case, a live status (what, elapsed) on a terminal, a summary table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.status import Status
from rich.table import Table

from zbench.suite import Case


def make_console(*, stderr: bool) -> Console:
    """Off a terminal (CI logs, pipes) tables and lines are not squeezed into 80 columns."""
    console = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console = Console(stderr=stderr, highlight=False, soft_wrap=True, width=200)
    return console


def stderr_console() -> Console:
    """Progress and summaries go to stderr so stdout stays clean for --json."""
    return make_console(stderr=True)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def verdict_text(record: dict) -> str:
    eq = record.get("equivalence")
    if record["status"] != "ok" or not eq:
        return "-"
    if eq.get("equivalent"):
        return "reference" if eq.get("reference_case") == record["case_id"] else f"equivalent ({eq['max_rel_loss_diff']:.1e})"
    return "NOT EQUIVALENT: " + eq.get("reason", "")


def status_text(record: dict) -> str:
    if record["status"] == "skipped":
        return f"skipped: {record['skip_reason']}"
    if record["status"] != "ok":
        return f"{record['status']}: {record.get('error') or ''}"
    return "ok"


class Progress:
    """Progress for a suite run. ``quiet`` prints nothing (``--json`` keeps stdout for the JSON)."""

    def __init__(self, console: Console | None = None, *, quiet: bool = False) -> None:
        self.console = console or stderr_console()
        self.quiet = quiet
        self.total = 0
        self._status: Status | None = None

    def _print(self, *args) -> None:
        if not self.quiet:
            self.console.print(*args)

    def start(self, run_id: str, path: Path, total: int) -> None:
        self.total = total
        self._print(f"run [bold]{run_id}[/]: {total} cases -> {escape(str(path))}")

    def _prefix(self, index: int, case: Case) -> str:
        return f"[{index}/{self.total}] {case.case_id}"

    def case_started(self, index: int, case: Case) -> None:
        if self.quiet:
            return
        if self.console.is_terminal:
            self._status = self.console.status(escape(f"{self._prefix(index, case)}: launching {case.world_size} ranks"))
            self._status.start()
        else:
            self._print(escape(f"{self._prefix(index, case)}: running on {case.world_size} {case.device} ranks ..."))

    def case_update(self, index: int, case: Case, what: str, elapsed: float) -> None:
        if self._status is not None:
            self._status.update(escape(f"{self._prefix(index, case)}: {what}, {elapsed:.0f} s"))

    def case_done(self, index: int, case: Case, record: dict) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        line = escape(f"{self._prefix(index, case)}: {status_text(record)}")
        if record["status"] == "ok":
            summary = record["summary"]
            line += escape(f", {fmt_seconds(summary['step_time_median_s'])}/step, ratio {fmt_ratio(record.get('ratio_to_ddp'))}, "
                           f"{verdict_text(record)}, {record['wall_s']:.1f} s")
            if record.get("warnings"):
                line += escape("; WARNING: " + "; ".join(record["warnings"]))
        elif record["status"] != "skipped":
            line = f"[red]{line}[/]"
        self._print(line)

    def case_reused(self, index: int, case: Case, record: dict) -> None:
        self._print(escape(f"{self._prefix(index, case)}: already stored ({record['status']}), not run again"))

    def summary(self, records: list[dict]) -> None:
        if not self.quiet:
            self.console.print(summary_table(records))


def summary_table(records: list[dict]) -> Table:
    table = Table(title="zbench results")
    table.add_column("case", no_wrap=True)
    for col in ("status", "step (median)", "ratio to DDP", "tokens/s", "peak memory", "model state", "vs DDP"):
        table.add_column(col)
    for r in records:
        summary = r.get("summary") or {}
        status = status_text(r)
        cells = (r["case_id"], status if len(status) <= 90 else status[:87] + "...",
                 fmt_seconds(summary.get("step_time_median_s")), fmt_ratio(r.get("ratio_to_ddp")),
                 f"{summary['tokens_per_s']:.0f}" if summary.get("tokens_per_s") else "-",
                 fmt_bytes((r.get("memory") or {}).get("peak_bytes")),
                 fmt_bytes((r.get("model_state") or {}).get("measured_total")), verdict_text(r))
        table.add_row(*(Text(c) for c in cells))
    return table
