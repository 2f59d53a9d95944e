"""A deep model's trace from two shallow cuts of it: ``tune`` traces ``NAME@blocks=5`` and ``NAME@blocks=6``
(``zbench.depth``) and extrapolates over blocks, instead of tracing all of a 70B model's 80 layers.

A transformer's blocks are alike, so each figure a step produces is one part that does not depend on depth
(embeddings, head, final norm, the loss) plus one per block: model-state bytes by category and location, each
phase's collectives (bytes and calls) and each phase's compute seconds on the cluster's operator rates. So
``Q(L) = Q(5) + (L - 5) * (Q(6) - Q(5))``.

The peak of live bytes is not one such figure: it is the largest of many moments, and which moment wins can
change with depth (``deep_peak``), so it is extrapolated segment by segment of the step and the largest taken.

Where it is not exact: flat buffers padded to a multiple of the ranks (less than one element per rank per
buffer), bucket counts that round, a peak inside a segment whose own moment moves. docs/methods.md#tuning-zbench-tune
has the check against whole traces (tests/benchmarks/validate_extrapolation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.formulas import placement_for
from zbench.cases.model_source import model_info
from zbench.depth import at_depth, split_depth
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.sweep import operator_compute
from zbench.plan.trace.plan import TracedRow

#: Blocks at each end of the model whose live bytes differ from the blocks between them (``deep_peak``): the
#: first and the last, and their neighbours (a stage-3 engine prefetches the next block's parameters, and a
#: second block's backward still holds what the first block's prefetch brought).
EDGE = 2

#: The depths of the two cuts traced: one apart (the lines' step), with one steady block between the edges in the
#: shallower and two in the deeper (``deep_peak``'s plane needs three points).
DEPTHS = (2 * EDGE + 1, 2 * EDGE + 2)

#: Models of at most this many blocks are traced whole: the cuts (11 blocks in all) would save nothing.
TRACE_WHOLE_UP_TO = 12


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


def _combine(terms: list[tuple[float, Any]]) -> Any:
    """``sum(c * x)`` through nested dicts of numbers (a key a term lacks counts as 0); ints stay ints (rounded)."""
    if any(isinstance(x, dict) for _, x in terms):
        keys = {key: None for _, x in terms if isinstance(x, dict) for key in x}
        return {key: _combine([(c, x.get(key, 0) if isinstance(x, dict) else 0) for c, x in terms]) for key in keys}
    numbers = [(c, x) for c, x in terms if isinstance(x, int | float) and not isinstance(x, bool)]
    if len(numbers) < len(terms):
        return terms[-1][1]  # not a number (a name): the deeper cut's
    value = sum(c * x for c, x in numbers)
    return round(value) if all(isinstance(x, int) for _, x in numbers) else value


def steps_beyond(blocks: int) -> float:
    """How many steps of ``deeper cut - shallower cut`` a ``blocks``-deep model lies beyond the shallower cut."""
    return (blocks - DEPTHS[0]) / (DEPTHS[1] - DEPTHS[0])


def _line(a: Any, b: Any, k: float) -> Any:
    """``a + k (b - a)``: ``k`` steps of the difference between two cuts beyond the first."""
    return _combine([(1 - k, a), (k, b)])


def deep_peak(a: dict[str, Any], b: dict[str, Any], blocks: int) -> dict[str, Any]:
    """A location's peak in the ``blocks``-deep model from its two cuts' segments (``zbench.plan.trace.live.Peak``).

    Each segment that is not a block's (the step's start, after the blocks, the optimizer step) lies on a line
    over depth. A block's forward or backward segment depends on depth and on the block's place: each of the
    ``EDGE`` blocks at either end lies on a line of its own; a steady block between them on the plane
    ``v(L, i) = v(5, 2) + (L - 5) (v(6, 2) - v(5, 2)) + (i - 2) (v(6, 3) - v(6, 2))`` (what earlier blocks left
    behind, such as checkpointed inputs, grows with ``i``), evaluated at both ends of the steady stretch. The
    peak is the largest of them all, and of the line through the cuts' own peaks. Without segments (a model
    without blocks): the line through the peaks.
    """
    shallow, deep = DEPTHS
    k = steps_beyond(blocks)
    candidates = [_line(_moment(a), _moment(b), k)]
    sa, sb = a.get("segments", {}), b.get("segments", {})
    if sa and sb:
        for name in {*sa, *sb}:
            if not _block_segment(name):
                candidates.append(_line(sa.get(name, {}), sb.get(name, {}), k))
        for kind in ("forward", "backward"):
            a_at = [sa.get(f"{kind} {i}", {}) for i in range(shallow)]
            b_at = [sb.get(f"{kind} {i}", {}) for i in range(deep)]
            for j in range(EDGE):
                candidates.append(_line(a_at[j], b_at[j], k))
                candidates.append(_line(a_at[-1 - j], b_at[-1 - j], k))
            steady = _line(a_at[EDGE], b_at[EDGE], k)  # v(L, EDGE)
            for i in (EDGE, blocks - 1 - EDGE):
                candidates.append(_combine([(1, steady), (i - EDGE, b_at[EDGE + 1]), (EDGE - i, b_at[EDGE])]))
    top = max(candidates, key=lambda m: m.get("bytes", 0) if isinstance(m, dict) else 0)
    return {"bytes": top.get("bytes", 0), "roles": top.get("roles", {})}


def _moment(peak: dict[str, Any]) -> dict[str, Any]:
    return {"bytes": peak.get("bytes", 0), "roles": peak.get("roles", {})}


def _block_segment(name: str) -> bool:
    kind, _, index = name.partition(" ")
    return kind in ("forward", "backward") and index.isdigit()


@dataclass
class Extrapolated:
    """The full model's setup as the line through its two cuts."""

    case: Case
    shallow: TracedRow
    deeper: TracedRow

    @property
    def blocks(self) -> int:
        return len(model_info(self.case.model).block_sizes)

    @property
    def k(self) -> float:
        return steps_beyond(self.blocks)

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
            peak={loc: deep_peak(a.peak.get(loc, {}), b.peak.get(loc, {}), self.blocks) for loc in {*a.peak, *b.peak}},
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
