"""Benchmark: the harness's own overhead on the CPU anchor workload (goal: <= 2% median).

Not part of the default test run (it measures, it does not check). Run:
    python -m pytest tests/benchmarks -m benchmark --benchmark-enable -s
The figure is printed and stored in pytest-benchmark's ``extra_info``.
"""

import pytest

from zbench.measure.overhead import measure


@pytest.mark.benchmark
def test_harness_overhead(benchmark):
    result = benchmark.pedantic(measure, kwargs={"rounds": 8, "block": 10}, rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "samples"})
    print(f"\nharness overhead: bare {result['bare_step_s'] * 1e3:.2f} ms/step, instrumented "
          f"{result['instrumented_step_s'] * 1e3:.2f} ms/step, overhead {result['overhead_pct']:+.2f}% (goal <= 2%)")
