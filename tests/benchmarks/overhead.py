"""How much do zbench's instruments cost? The anchor workload, bare and fully instrumented, interleaved.

Two ranks (gloo) train the ``small`` GPT with DDP (micro-batch 4, AdamW, fp32)
in alternating blocks of steps: *bare* (``engine.step`` and nothing else) and
*instrumented* (everything the worker does per step: the communication ledger,
barrier-started timing, the forward/backward/optimizer phase clock, ledger
snapshots, metrics). Each round times one block of each, the order alternating
from round to round, so drift cancels. Two figures: the median instrumented
block time over the median bare one, and the median over rounds of the paired
ratio (instrumented over bare in the same round), which also cancels load that
changes more slowly than a round; the goal (<= 2%) is checked on the second.

Defaults: 200 rounds of one-step blocks. On a shared 2-core machine the paired ratio
of a single round spreads by about +-8% (another process takes a core, a barrier waits
milliseconds for a descheduled peer), so the median needs many pairs to resolve 2%,
and one-step blocks keep each pair a fraction of a second apart, within one load level.

It lives here, not in ``zbench.measure``, because it builds an implementation and
launches ranks, which instruments never do. Run it from the repository root:
``python -m tests.benchmarks.overhead`` (or ``tests/benchmarks/test_overhead.py``).
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tests.benchmarks.ranks import run_ranks
from zbench.cases.models import build_model, get_config, rank_micro_batches, synthetic_batch
from zbench.implementations.ddp import DDP
from zbench.measure import comms
from zbench.measure.phases import PhaseClock
from zbench.measure.timing import timed
from zbench.protocol import TrainSpec

GOAL_PCT = 2.0
"""The instruments may add at most this much to the median step (paired, per round)."""


def _rank(rank: int, world: int, rounds: int, block: int, model: str) -> dict[str, list[float]]:
    """Per-step time of each bare and each instrumented block, in round order (the same on every rank)."""
    device = torch.device("cpu")
    module = build_model(model, seed=0)
    engine = DDP().build(module, TrainSpec(device=device), dist.group.WORLD)
    clock = PhaseClock(module, device)
    cfg = get_config(model)
    batches = [
        rank_micro_batches(synthetic_batch(cfg, seed=0, step=i, rows=4 * world), rank=rank, world=world, grad_accum=1)
        for i in range(block)
    ]

    def bare() -> None:
        for mbs in batches:
            float(engine.step(mbs))

    def instrumented() -> None:
        for mbs in batches:
            comms.take()
            loss, _ = timed(partial(clock.run, partial(engine.step, mbs)), device=device, barrier=dist.barrier)
            comms.take()
            clock.read()
            float(loss)
            engine.metrics()

    bare()  # warm-up
    times: dict[str, list[float]] = {"bare": [], "instrumented": []}
    for r in range(rounds):
        for mode in ("bare", "instrumented") if r % 2 == 0 else ("instrumented", "bare"):
            if mode == "instrumented":
                comms.install()
                clock.attach()
            else:
                comms.uninstall()
                clock.detach()
            dist.barrier()
            start = time.perf_counter()
            (instrumented if mode == "instrumented" else bare)()
            dist.barrier()
            times[mode].append((time.perf_counter() - start) / block)
    comms.uninstall()
    clock.detach()
    return times


def measure(*, rounds: int = 200, block: int = 1, model: str = "small", world: int = 2) -> dict[str, Any]:
    """Median per-step time bare and instrumented, the overhead of one over the other and the paired overhead."""
    times = run_ranks(_rank, rounds, block, model, world=world)
    bare, inst = statistics.median(times["bare"]), statistics.median(times["instrumented"])
    paired = statistics.median(i / b for i, b in zip(times["instrumented"], times["bare"]))
    return {
        "bare_step_s": bare,
        "instrumented_step_s": inst,
        "overhead_pct": (inst / bare - 1) * 100,
        "paired_overhead_pct": (paired - 1) * 100,
        "samples": times,
        "model": model,
        "world": world,
        "rounds": rounds,
        "block": block,
    }


def describe(result: dict[str, Any]) -> str:
    """One line: both step times and both overhead figures, next to the goal."""
    return (
        f"bare {result['bare_step_s'] * 1e3:.2f} ms/step, instrumented {result['instrumented_step_s'] * 1e3:.2f} "
        f"ms/step, overhead {result['overhead_pct']:+.2f}% (medians), {result['paired_overhead_pct']:+.2f}% "
        f"(paired per round; goal <= {GOAL_PCT:g}%)"
    )


if __name__ == "__main__":
    print(describe(measure()))
