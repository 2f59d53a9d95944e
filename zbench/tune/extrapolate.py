"""A deep model's trace from two shallow cuts of it: ``tune`` traces ``NAME@blocks=2`` and ``NAME@blocks=3``
(``zbench.cases.depth``) and extrapolates over blocks, instead of tracing all of a 70B model's 80 layers.

A transformer's blocks are alike, so each figure a step produces is one part that does not depend on depth
(embeddings, head, final norm, the loss) plus one per block: model-state bytes by category and location, the
peak of live bytes and each role in it, each phase's collectives (bytes and calls) and each phase's compute
seconds on the cluster's operator rates. So ``Q(L) = Q(2) + (L - 2) * (Q(3) - Q(2))``.

Where it is not exact: flat buffers padded to a multiple of the ranks (less than one element per rank per
buffer), a peak that moves to another moment of the step as the model deepens (the two cuts see one moment;
three cuts would show a bend, and docs/methods.md#tuning-zbench-tune has the check against full traces), bucket
counts that round. Two blocks, not one, as the shallow cut: with one block a stage-3 engine has no next block
to prefetch, so its working set would not be the deep model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.depth import at_depth, split_depth
from zbench.cases.formulas import placement_for
from zbench.cases.model_source import model_info
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.sweep import operator_compute
from zbench.plan.trace.plan import TracedRow

#: The depths of the two cuts traced.
DEPTHS = (2, 3)

#: Models of at most this many blocks are traced whole: the cuts would save little.
TRACE_WHOLE_UP_TO = 6


def can_extrapolate(case: Case) -> bool:
    """A preset or transformers model (a builder's cannot be cut) of more than ``TRACE_WHOLE_UP_TO`` blocks, and an
    implementation that declares itself ``blockwise``."""
    from zbench.cases.model_names import is_builder_path

    if split_depth(case.model)[1] is not None or is_builder_path(case.model):
        return False
    if not registry.resolve(case.implementation).capabilities.blockwise:
        return False
    return len(model_info(case.model).block_sizes) > TRACE_WHOLE_UP_TO


def cuts(case: Case) -> tuple[Case, Case]:
    """The case on its model cut to each of ``DEPTHS`` blocks."""
    shallow, deeper = (case.model_copy(update={"model": at_depth(case.model, d)}) for d in DEPTHS)
    return shallow, deeper


def _line(a: Any, b: Any, k: float) -> Any:
    """``a + k (b - a)`` through nested dicts of numbers (a key one side lacks counts as 0); ints stay ints."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        return {key: _line(a.get(key, 0), b.get(key, 0), k) for key in {**a, **b}}
    if isinstance(a, bool) or not isinstance(a, int | float) or not isinstance(b, int | float):
        return b
    value = a + k * (b - a)
    return round(value) if isinstance(a, int) and isinstance(b, int) else value


@dataclass
class Extrapolated:
    """The full model's setup as the line through its two cuts."""

    case: Case
    shallow: TracedRow
    deeper: TracedRow

    @property
    def k(self) -> float:
        """How many steps of ``deeper - shallow`` the full depth lies beyond the shallow cut."""
        blocks = len(model_info(self.case.model).block_sizes)
        return (blocks - DEPTHS[0]) / (DEPTHS[1] - DEPTHS[0])

    @property
    def error(self) -> str | None:
        return self.shallow.trace.error or self.deeper.trace.error

    def row(self) -> TracedRow:
        """A traced row for the full model: figures on the line, the operators left out (``phase_compute``)."""
        a, b = self.shallow.trace, self.deeper.trace
        trace = replace(
            b,
            case_id=self.case.case_id,
            state_bytes=_line(a.state_bytes, b.state_bytes, self.k),
            phases=_line(a.phases, b.phases, self.k),
            peak=_line(a.peak, b.peak, self.k),
            collectives=[],
            ops={},
            seconds=a.seconds + b.seconds,
            error=self.error,
        )
        return TracedRow(self.case, trace, placement_for(self.case))

    def phase_compute(self, cluster: Cluster, world: int) -> dict[str, float] | None:
        """Each phase's compute seconds on ``cluster`` at ``world`` ranks, on the line through the cuts'."""
        a, b = (operator_compute(r, cluster, world) for r in (self.shallow, self.deeper))
        return None if a is None or b is None else _line(a, b, self.k)
