"""``zbench compare A B``: a two-implementation suite built from flags, shown side by side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from zbench.errors import UsageError
from zbench.results.formatting import fmt_bytes, fmt_rate, fmt_ratio, fmt_seconds, status_text
from zbench.results.record import CaseRecord, SummaryRow
from zbench.run.console import Progress
from zbench.run.runner import RunResult, run_suite
from zbench.suite import config as suite_mod
from zbench.suite import preflight
from zbench.values import Precision

JSON_FIELDS = (
    "case_id",
    "implementation",
    "noise_twin",
    "precision",
    "status",
    "step_time_median_s",
    "step_time_iqr_s",
    "ratio_to_ddp",
    "tokens_per_s",
    "peak_memory_bytes",
    "model_state_bytes",
    "expected_model_state_bytes",
    "max_rel_loss_diff",
    "max_rel_param_diff",
    "equivalent",
    "failed_checks",
    "error",
)


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _worst_check(record: CaseRecord) -> str:
    """The equivalence check closest to (or furthest past) its bound, as a fraction of it."""
    eq = record.equivalence
    checks = [c for c in eq.checks if c.margin is not None] if eq else []
    if not checks:
        return "-"
    worst = max(checks, key=lambda c: c.margin or 0.0)
    return f"{worst.name} {worst.margin:.0%}"


def _equivalent(record: CaseRecord) -> str:
    eq = record.equivalence
    if eq is None:
        return "-"
    if record.config.noise_twin:
        return "noise twin"
    return "yes" if eq.equivalent else "NO" + (f" ({', '.join(eq.failed_checks)})" if eq.failed_checks else "")


ROWS: tuple[tuple[str, Callable[[SummaryRow, CaseRecord], str]], ...] = (
    ("status", lambda r, rec: status_text(rec)),
    ("median step time", lambda r, rec: fmt_seconds(r.step_time_median_s)),
    ("IQR", lambda r, rec: fmt_seconds(r.step_time_iqr_s)),
    ("ratio to DDP", lambda r, rec: fmt_ratio(r.ratio_to_ddp)),
    ("tokens/s", lambda r, rec: fmt_rate(r.tokens_per_s)),
    ("peak memory / rank", lambda r, rec: fmt_bytes(r.peak_memory_bytes)),
    ("model state / rank", lambda r, rec: fmt_bytes(r.model_state_bytes)),
    ("  ZeRO formula", lambda r, rec: fmt_bytes(r.expected_model_state_bytes)),
    ("max rel loss diff", lambda r, rec: _sci(r.max_rel_loss_diff)),
    ("param rel L2 diff", lambda r, rec: _sci(r.max_rel_param_diff)),
    ("worst check / bound", lambda r, rec: _worst_check(rec)),
    ("equivalent to DDP", lambda r, rec: _equivalent(rec)),
)


@dataclass
class Comparison:
    result: RunResult

    @property
    def failed(self) -> bool:
        return bool(self.result.failed) or any(r.status == "skipped" for r in self.result.records)

    def as_json(self) -> dict[str, Any]:
        return {
            "run_id": self.result.run.run_id,
            "results": str(self.result.run.path),
            "cases": [r.summary_row().model_dump(include=set(JSON_FIELDS)) for r in self.result.records],
        }

    def table(self) -> Table:
        records = self.result.records
        rows = [r.summary_row() for r in records]
        table = Table(title=f"zbench compare (run {self.result.run.run_id})")
        table.add_column("", no_wrap=True)
        mixed = len({r.precision for r in rows}) > 1  # a bf16 comparison's fp32 probe references beside it
        for r in rows:
            header = r.implementation + (" twin" if r.noise_twin else "") + (f" {r.precision}" if mixed else "")
            table.add_column(header, justify="right")
        for label, cell in ROWS:
            table.add_row(label, *(Text(cell(r, rec)) for r, rec in zip(rows, records)))
        return table


def prepare(
    a: str, b: str, *, device: str, nproc: int | None, model: str, steps: int, micro_batch: int, precision: Precision
) -> preflight.Suite:
    """The two-implementation suite; a combination either cannot run is bad input, before anything trains."""
    resolved = preflight.resolve_device(device)
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() if resolved == "cuda" else 2
    names = list(dict.fromkeys([a, b]))
    config = suite_mod.from_dict(
        {
            "name": f"compare {' vs '.join(names)}",
            "device": device,
            "models": [model],
            "implementations": names,
            "world_sizes": [nproc],
            "precisions": [precision],
            "steps": steps,
            "micro_batch": micro_batch,
            "warmup_steps": min(3, steps - 1),
        },
        source="compare",
    )
    suite = preflight.prepare(suite_mod.from_flags(config))
    skipped = [c for c in suite.cases if c.skip_reason]
    if skipped:
        c = skipped[0]
        raise UsageError(
            f"compare: {c.implementation} cannot run {model} at {precision} on {nproc} {resolved} "
            f"rank(s): {c.skip_reason}"
        )
    return suite


def run(suite: preflight.Suite, *, results: Path, quiet: bool) -> Comparison:
    return Comparison(run_suite(suite, results_root=results, progress=Progress(quiet=quiet)))
