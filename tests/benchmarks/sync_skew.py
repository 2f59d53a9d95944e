"""What a blocking collective between compute costs on CPU ranks beyond the compute and the call timed apart.

The step model charges each rank's compute and each collective on its own. Where ranks wait for each other
(a blocking all-reduce after a segment of compute) a rank pays the slowest rank's segment, not its own. Two
ranks on two cores, each sharing its core with the harness, gloo's threads and the system, drift apart, so every
such wait costs something that neither a compute probe nor a collective probe sees.

Two gloo ranks (``tests.benchmarks.ranks``), one thread each, time (each repeat from a barrier, rank 0's wall
clock): ``WAITS`` segments of matrix products alone, ``WAITS`` small all-reduces alone, and the two
interleaved; the extra per wait is ``interleaved - compute - calls``, per segment. Nothing in zbench reads it
yet (issue 30: docs/methods.md, Simulation).

``python -m tests.benchmarks.sync_skew [--segments 2 8 32 64 128] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from tests.benchmarks.ranks import run_ranks

WAITS, REPEATS, SIDE = 8, 7, 256


def _median_s(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _waits(rank: int, world: int, segments: list[int]) -> list[dict[str, float]]:
    a, b, small = torch.randn(SIDE, SIDE), torch.randn(SIDE, SIDE), torch.ones(2048)

    def compute(products: int) -> None:
        for _ in range(WAITS):
            for _ in range(products):
                torch.mm(a, b)

    def calls() -> None:
        for _ in range(WAITS):
            dist.all_reduce(small)

    def interleaved(products: int) -> None:
        for _ in range(WAITS):
            for _ in range(products):
                torch.mm(a, b)
            dist.all_reduce(small)

    rows = []
    for products in segments:
        alone = _median_s(partial(compute, products)) / WAITS
        call = _median_s(calls) / WAITS
        both = _median_s(partial(interleaved, products)) / WAITS
        rows.append({"segment_ms": alone * 1e3, "call_ms": call * 1e3, "interleaved_ms": both * 1e3,
                     "extra_per_wait_ms": (both - alone - call) * 1e3,
                     "extra_share_of_segment": (both - alone - call) / alone})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, nargs="+", default=[2, 8, 32, 64, 128],
                        help=f"matrix products ({SIDE} x {SIDE}) between two waits")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the rows here (JSON)")
    args = parser.parse_args()
    rows = run_ranks(_waits, args.segments, world=2, threads=1)
    for r in rows:
        print(
            f"segment {r['segment_ms']:7.2f} ms  call {r['call_ms']:5.2f} ms  "
            f"interleaved {r['interleaved_ms']:7.2f} ms  "
            f"extra per wait {r['extra_per_wait_ms']:5.2f} ms ({r['extra_share_of_segment']:+.0%} of the segment)"
        )
    if args.out:
        args.out.write_text(json.dumps({"measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                        "torch": torch.__version__, "rows": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
