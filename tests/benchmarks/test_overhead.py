"""Benchmark: the harness's own overhead on the CPU anchor workload must stay within its goal (<= 2%).

Not part of the default test run (two to four minutes, and its verdict depends on the machine). Run:
    python -m pytest tests/benchmarks/test_overhead.py -m benchmark --benchmark-enable -s

The goal is checked on the paired figure (median over rounds of instrumented over bare in the
same round; see ``tests/benchmarks/overhead.py``), which cancels slow changes in load. A busy
machine can still push one attempt over, so an attempt over the goal is measured once more and
the second attempt decides; both are printed and stored in pytest-benchmark's ``extra_info``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks.overhead import GOAL_PCT, describe, measure


def attempts() -> list[dict[str, Any]]:
    """One measurement, and a second one when the first is over the goal."""
    first = measure()
    return [first] if first["paired_overhead_pct"] <= GOAL_PCT else [first, measure()]


@pytest.mark.benchmark
def test_harness_overhead(benchmark):
    results = benchmark.pedantic(attempts, rounds=1, iterations=1)
    benchmark.extra_info["attempts"] = [{k: v for k, v in r.items() if k != "samples"} for r in results]
    print("\nharness overhead:\n" + "\n".join(f"  attempt {i}: {describe(r)}" for i, r in enumerate(results, 1)))
    assert results[-1]["paired_overhead_pct"] <= GOAL_PCT, describe(results[-1])
