"""Benchmark: step time of the reference ZeRO engines against DDP, interleaved in one process group.

Not part of the default test run (a couple of minutes on 2 cores). Run:
    python -m pytest tests/benchmarks/test_zero_step_time.py -m benchmark --benchmark-enable -s
or, for the table alone and other workloads or engine options (``--help``):
    python -m tests.benchmarks.test_zero_step_time

Every rank builds DDP, zero1, zero2 and zero3 on identical models and, step after step, times one
step of each in turn (rotating which goes first), between barriers, with perf_counter; warm-up
steps are dropped. The table gives each engine's median step time, the ratio of its median to
DDP's, and the median over steps of the paired ratio (its step time over DDP's in the same step),
which cancels load that changes more slowly than one round of steps: on a shared machine trust
that one, and it is the one checked. Defaults: world 2 on CPU (gloo), the ``small`` preset,
micro-batch 4 per rank, AdamW, fp32, one thread per rank.

The engine's goals are paired ratios of at most 1.05 (zero1, zero2) and 1.25 (zero3). The bars
checked here are 5 points looser (1.10, 1.10, 1.30): on a shared 2-core machine two ranks and
whatever else runs there compete for the cores, and repeated runs of the same code spread by
about that much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.benchmarks.ranks import run_ranks
from zbench.cases import registry
from zbench.cases.models import build_model, get_config, rank_micro_batches, synthetic_batch
from zbench.protocol import TrainSpec

IMPLS = ("ddp", "zero1", "zero2", "zero3")
BARS = {"zero1": 1.10, "zero2": 1.10, "zero3": 1.30}
"""Highest paired ratio to DDP allowed: the engine's goals plus 5 points of noise (see the module docstring)."""


def engine_spec(label: str) -> tuple[str, int]:
    """``IMPL`` or ``IMPL@STAGE`` (``fsdp1@2``: FSDP1's SHARD_GRAD_OP) as (implementation, stage); the
    implementation's highest stage when none is named."""
    impl, _, stage = label.partition("@")
    return impl, int(stage) if stage else max(registry.resolve(impl).capabilities.stages)


@dataclass(frozen=True)
class Workload:
    """What every engine trains, and which engines: ``runs`` maps a label to (``IMPL[@STAGE]``, options)."""

    world: int = 2
    model: str = "small"
    micro_batch: int = 4
    precision: str = "fp32"
    steps: int = 30
    warmup: int = 5
    threads: int = 1
    runs: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=lambda: {name: (name, {}) for name in IMPLS})


def _rank(rank: int, world: int, work: Workload) -> dict[str, list[float]]:
    """Each engine's post-warm-up step times on this rank, step by step (the same steps for every engine)."""
    engines = {}
    for label, (name, options) in work.runs.items():
        impl, stage = engine_spec(name)
        spec = TrainSpec(device=torch.device("cpu"), precision=work.precision, lr=1e-3, stage=stage, options=options)
        engines[label] = registry.resolve(impl).build(build_model(work.model, seed=0), spec, dist.group.WORLD)
    cfg = get_config(work.model)
    names = list(work.runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(work.warmup + work.steps):
        batch = synthetic_batch(cfg, seed=0, step=step, rows=work.micro_batch * world)
        micro_batches = rank_micro_batches(batch, rank=rank, world=world, grad_accum=1)
        order = names[step % len(names) :] + names[: step % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            engines[name].step(micro_batches)
            dist.barrier()
            if step >= work.warmup:
                times[name].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.close()
    return times


@dataclass(frozen=True)
class EngineStats:
    """One engine's step time; the ratios are to DDP's and ``None`` when DDP was not timed."""

    median_s: float
    q1_s: float
    q3_s: float
    median_ratio: float | None
    paired_ratio: float | None


def step_times(work: Workload) -> dict[str, EngineStats]:
    """Per engine: median step time, quartiles, and the ratio of its median to DDP's and the paired one."""
    times = run_ranks(_rank, work, world=work.world, threads=work.threads)
    ref = times.get("ddp")
    stats = {}
    for name, samples in times.items():
        q1, _, q3 = statistics.quantiles(samples, n=4)
        median = statistics.median(samples)
        stats[name] = EngineStats(
            median_s=median,
            q1_s=q1,
            q3_s=q3,
            median_ratio=median / statistics.median(ref) if ref else None,
            paired_ratio=statistics.median(t / d for t, d in zip(samples, ref)) if ref else None,
        )
    return stats


def table(work: Workload, stats: dict[str, EngineStats]) -> str:
    """The workload on one line, then one line per engine (times in ms)."""
    lines = [
        f"{work.model}, world {work.world}, micro-batch {work.micro_batch}, {work.precision}, "
        f"{work.threads} thread(s)/rank, {work.steps} timed steps after {work.warmup} warm-up, "
        f"load average {os.getloadavg()[0]:.2f}"
    ]
    for name, s in stats.items():
        line = f"  {name:12s} median {s.median_s * 1e3:7.1f} ms  (IQR {s.q1_s * 1e3:.1f}-{s.q3_s * 1e3:.1f})"
        if s.median_ratio is not None and s.paired_ratio is not None:
            line += f"  median/ddp {s.median_ratio:.3f}  paired {s.paired_ratio:.3f}"
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.benchmark
def test_zero_step_time_vs_ddp(benchmark):
    work = Workload()
    stats = benchmark.pedantic(step_times, args=(work,), rounds=1, iterations=1)
    benchmark.extra_info.update({"workload": asdict(work), "engines": {n: asdict(s) for n, s in stats.items()}})
    print("\n" + table(work, stats))
    paired = {name: stats[name].paired_ratio for name in BARS}
    over = {name: ratio for name, ratio in paired.items() if ratio is None or ratio > BARS[name]}
    assert not over, f"paired step-time ratio to DDP over the bar {BARS}: {over}"


def main(argv: list[str] | None = None) -> None:
    """Print the table for the workload and engines given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--impls", nargs="+", default=list(IMPLS), help="IMPL or IMPL@STAGE (fsdp1@2 is SHARD_GRAD_OP), DDP first"
    )
    parser.add_argument("--options", default="{}", help='zero options by name, JSON: \'{"zero2": {"bucket_mb": 8}}\'')
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="another engine to time, LABEL=IMPL:JSON_OPTIONS, e.g. 'z2-16mb=zero2:{\"bucket_mb\": 16}'",
    )
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    runs = {name: (name, options.get(name, {})) for name in args.impls}
    for variant in args.variant:  # LABEL=IMPL:JSON
        label, _, rest = variant.partition("=")
        impl, _, opts = rest.partition(":")
        runs[label] = (impl, json.loads(opts or "{}"))
    work = Workload(
        world=args.world,
        model=args.model,
        micro_batch=args.micro_batch,
        precision=args.precision,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        runs=runs,
    )
    print(table(work, step_times(work)))


if __name__ == "__main__":
    main()
