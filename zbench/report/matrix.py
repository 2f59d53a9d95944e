"""The front page's answer: per model (and world size, precision), every implementation x stage x offload side by side.

A row holds the cases that differ only in how they shard and offload, so their
step times and memory compare directly. In each row the **fastest** (by the
ratio to DDP, measured in paired rounds where the run took them) and the
**leanest** setups are marked among the cases that finished and train like DDP
(a case that ran out of memory does not fit; one that diverged is no answer).
Noise twins (DDP run twice to measure noise) are not setups and stay out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from zbench.cases.case import REFERENCE
from zbench.results.record import CaseRecord

Column = tuple[str, int, str]
"""implementation, stage, offload"""


@dataclass
class Row:
    model: str
    world_size: int
    precision: str
    device: str
    cells: dict[Column, list[CaseRecord]] = field(default_factory=dict)
    fastest: str | None = None
    leanest: str | None = None

    @property
    def label(self) -> str:
        return f"{self.model}, {self.world_size} x {self.device}, {self.precision}"


@dataclass
class Matrix:
    columns: list[Column]
    rows: list[Row]


def _qualifies(r: CaseRecord) -> bool:
    """Finished, and trains like DDP (the reference itself qualifies)."""
    return r.ok and bool(r.equivalent) and r.step_time_median_s is not None


def _column_order(column: Column) -> tuple[int, str, int, str]:
    implementation, stage, offload = column
    return (implementation != REFERENCE, implementation, stage, offload)


def _speed_key(cases: list[CaseRecord]) -> Callable[[CaseRecord], float]:
    """The ratio to DDP when every case has one (paired rounds cancel the machine's drift between cases, which
    can be 3x on a shared machine), else the median step time."""
    if all(r.ratio_to_ddp is not None for r in cases):
        return lambda r: r.ratio_to_ddp or 0.0
    return lambda r: r.step_time_median_s or 0.0


def build(records: list[CaseRecord]) -> Matrix:
    rows: dict[tuple[str, int, str, str], Row] = {}
    columns: set[Column] = set()
    for r in records:
        c = r.config
        if c.noise_twin:
            continue
        key = (c.model, c.world_size, c.precision, c.device)
        row = rows.setdefault(key, Row(*key))
        column = (c.implementation, c.stage, c.offload)
        columns.add(column)
        row.cells.setdefault(column, []).append(r)
    for row in rows.values():
        finished = [r for cell in row.cells.values() for r in cell if _qualifies(r)]
        if finished:
            row.fastest = min(finished, key=_speed_key(finished)).case_id
            measured = [r for r in finished if r.peak_bytes is not None]
            if measured:
                row.leanest = min(measured, key=lambda r: r.peak_bytes or 0).case_id
    return Matrix(sorted(columns, key=_column_order), list(rows.values()))
