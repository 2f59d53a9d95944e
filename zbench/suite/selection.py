"""``zbench run -k PATTERN``: run some of a suite's cases without editing it.

``-k PATTERN`` keeps the cases whose id contains PATTERN (or matches it as a glob when it has ``*``,
``?`` or ``[``), together with the DDP reference (and noise twin) each kept case is judged against, and the fp32
ones its fp32 probe is judged against.
(``--set KEY=VALUE``, its companion, is ``zbench.suite.config.with_overrides``.)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from zbench.cases.case import REFERENCE, Case
from zbench.errors import UsageError


def _matches(case_id: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(case_id, pattern)
    return pattern in case_id


def select(cases: Sequence[Case], patterns: Iterable[str]) -> tuple[Case, ...]:
    """The cases ``patterns`` name (any of them), with the references they are judged against, in suite order;
    no pattern keeps every case. A pattern that names no case is bad input: a typo would otherwise run nothing."""
    patterns = list(patterns)
    if not patterns:
        return tuple(cases)
    for pattern in patterns:
        if not any(_matches(c.case_id, pattern) for c in cases):
            sample = ", ".join(c.case_id for c in cases[:3])
            raise UsageError(f"-k {pattern}: matches none of the suite's {len(cases)} cases (ids look like {sample})")
    chosen = {c.case_id for c in cases if any(_matches(c.case_id, p) for p in patterns)}
    kept = [c for c in cases if c.case_id in chosen and c.implementation != REFERENCE]
    judged = {c.reference_key for c in kept} | {k for c in kept if c.fp32_probe for k in c.probe_reference_keys}
    return tuple(
        c for c in cases if c.case_id in chosen or (c.implementation == REFERENCE and c.reference_key in judged)
    )
