"""Compute time of a traced step, operator by operator, from a calibrated profile (``zbench calibrate``) or a
datasheet profile's published operator rates (``zbench.plan.simulate.datasheet``: one rate per dtype, one bandwidth).

Each operator the trace recorded (``zbench.plan.trace.ops``) is charged:

- if it has FLOPs (matrix products, attention): its FLOPs at the rate the calibration measured for matrix
  products of that dtype and of about that size (linear in log FLOPs between the measured points, the
  nearest point's rate beyond them; the training dtype's table where its own was not measured); fused attention
  at its kernel's own rate where a datasheet profile quotes one;
- otherwise: the bytes it reads and writes at the measured memory bandwidth (the median of ``copy`` and
  ``add``);
- on a CPU, the bytes of the large tensors it creates at the rate a rank maps fresh pages (``mapped_gb_s``:
  zbench's CPU ranks map every block of 128 KiB or more, ``zbench.measure.memory``), added to its work;
- each operator's work times its factor where the calibration measured one (``operator_factors``: the
  operator's time inside a profiled training step over what the tables charge it, ``zbench.plan.calibrate.
  in_step``: GELU computes more per byte than ``add``, the optimizer's operators stream from memory; in bf16 a
  CPU's fused attention runs far slower per FLOP than its products, so a reduced precision has factors of its own);
- every call, the calibrated cost of an operator of negligible work inside a training step (``op_call_us``:
  autograd, module calls, the optimizer's loop): on a CPU added to the work (the same thread does both), on
  a GPU the larger of the two (the host launches ahead while the device works).

On a CPU profile the operators' total is multiplied by the calibration's step residual (``step_residuals``): a
probe model's whole step, timed without the profiler, over what this model charges it, the time a step spends
outside the operators the ledger records (the autograd engine, the optimizer's Python, freeing tensors); by the
case's dtype, linear in log charge between the probes (the nearest probe's beyond them; fp32's where the dtype
was not probed; 1 where the profile has none).

On a CPU profile each implementation's own host work beyond its operators (hooks, wrappers, Python between the
operators; ``zbench.plan.calibrate.overheads``) is added to the step, as measured per step, per block and per
parameter element; it is charged with the optimizer step (``after_backward``), where nothing hides it.

The optimizer step (``after_backward``) of a stage that shards it shrinks with the world size: each of the
trace's operators at ``traced_world`` ranks keeps its calls but has its work scaled by ``traced_world /
world``. An approximation: a few of that phase's operators do not shrink (ZeRO-1/2's copies into the full
parameters, torch_zero's whole tensors). The trace runs on fake CPU tensors, so a GPU profile is charged the
CPU code paths' operators (e.g. AdamW's per-tensor loop rather than a fused kernel, the CPU attention
kernel): the same FLOPs, more calls.
"""

from __future__ import annotations

import bisect
import math
import os
import statistics
from typing import TYPE_CHECKING, Any

from zbench.cases.model_source import model_info
from zbench.plan.simulate.calibration import Calibration, MatmulPoint, dtype_name, factor_key, overhead_key
from zbench.plan.simulate.datasheet import DatasheetRates
from zbench.protocol import COMPUTE_DTYPES

if TYPE_CHECKING:
    from zbench.cases.case import Case

#: Where operator rates come from: a calibration's measured tables or a datasheet's figures (same attributes).
Rates = Calibration | DatasheetRates


def _rate_table(cal: Rates, dtype: str) -> list[tuple[float, float]]:
    """``(log FLOPs, FLOP/s)`` of the measured products in ``dtype`` (else the first dtype measured), sorted."""
    points: list[MatmulPoint] = [p for p in cal.matmul if p.dtype == dtype] or [
        p for p in cal.matmul if p.dtype == cal.matmul[0].dtype
    ]
    return sorted((math.log(2 * p.m * p.k * p.n), p.tflops * 1e12) for p in points)


def flop_rate(cal: Rates, dtype: str, flops: float) -> float:
    """FLOP/s for one operator of ``flops`` in ``dtype``: interpolated between measured products of nearby size."""
    return _interpolated(_rate_table(cal, dtype), math.log(max(flops, 1.0)))


def _interpolated(table: list[tuple[float, float]], x: float) -> float:
    """The rate at ``x`` (a log size), linear between the sorted ``(log size, rate)`` points around it, the
    nearest end's rate outside them."""
    keys = [k for k, _ in table]
    i = bisect.bisect_left(keys, x)
    if i == 0:
        return table[0][1]
    if i == len(table):
        return table[-1][1]
    (x0, r0), (x1, r1) = table[i - 1], table[i]
    return r0 + (r1 - r0) * (x - x0) / (x1 - x0) if x1 > x0 else max(r0, r1)


def attention_rate(cal: Rates, op: str) -> float | None:
    """FLOP/s of a fused attention operator where the profile quotes its kernel's own rate (a datasheet profile's
    ``attention_tflops``), else None: charged as a matrix product of its FLOPs."""
    if isinstance(cal, DatasheetRates) and cal.attention_tflops and "attention" in op:
        return cal.attention_tflops * 1e12
    return None


#: Bytes a memory-bound probe moves per byte of its input: ``copy`` reads and writes, ``add`` reads two and writes.
_MOVED_PER_INPUT_BYTE = {"copy": 2, "add": 3}


def memory_bandwidth(cal: Rates, moved_bytes: float | None = None) -> float:
    """Bytes per second for a memory-bound operator that moves ``moved_bytes`` (reads and writes) per call: between
    the calibration's probes of nearby working sets (each size's median over ``copy`` and ``add``), since an
    operator whose tensors stay in cache runs several times faster than one that streams from memory (the 2-core
    CPU machine, 2026-11-28: 83-115 GB/s at 256 KiB, 22-32 at 1-16 MiB, 12-13 at 64 MiB); one size probed (an
    older calibration, a datasheet), or no size asked: its median."""
    if moved_bytes is None:
        return statistics.median(b.gb_s for b in cal.memory_bound) * 1e9
    by_size: dict[float, list[float]] = {}
    for b in cal.memory_bound:
        by_size.setdefault(math.log(b.bytes * _MOVED_PER_INPUT_BYTE.get(b.op, 1)), []).append(b.gb_s)
    table = sorted((size, statistics.median(rates) * 1e9) for size, rates in by_size.items())
    return _interpolated(table, math.log(max(moved_bytes, 1.0)))


def host_share(share: float) -> float:
    """The share of a CPU rank's speed that its host work (operator dispatch, the implementation's Python) gets:
    extra threads do not speed up one thread's Python, less than a core slows it as it slows everything."""
    return min(share, 1.0)


def work_seconds(entry: dict[str, Any], cal: Rates, *, on_gpu: bool) -> float:
    """One call's work as the tables charge it: its FLOPs at the matrix-product rate of its size (or its fused
    attention's rate), else its bytes at the bandwidth of its working set; on a CPU, its fresh pages too."""
    if entry["flops"] > 0:
        work = entry["flops"] / (attention_rate(cal, entry["op"]) or flop_rate(cal, entry["dtype"], entry["flops"]))
    else:
        work = entry["bytes"] / memory_bandwidth(cal, entry["bytes"])
    if not on_gpu and cal.mapped_gb_s:
        work += entry.get("mapped_bytes", 0) / (cal.mapped_gb_s * 1e9)  # traces before it was recorded: none
    return work


def operator_factor(cal: Rates, entry: dict[str, Any]) -> float:
    """What one call of this operator takes inside a training step over what the tables charge it
    (``Calibration.operator_factors``, ``zbench.plan.calibrate.in_step``): linear in log size (FLOPs, else bytes,
    per call) between the probed sizes, the nearest probe's beyond them; 1 where the calibration did not measure
    the operator (a datasheet profile, an older calibration, an operator the probe model does not run).

    Past the largest probe a memory-bound operator keeps the rate it ran at there, not its factor: the tables'
    rate falls as a working set outgrows the caches, and the probe's factor already carries that fall (a step
    finds its tensors cold, the tables' repeats warm), so applying it to the lower rate again would count the
    fall twice (AdamW over ``medium``'s 25 MB embedding was charged twice its time that way).

    An operator in a reduced precision takes its dtype's own factor where the calibration probed one
    (``<op>:<dtype>``, ``in_step.AUTOCAST_DTYPES``), else the fp32 probes'."""
    factors = cal.operator_factors
    points = factors.get(factor_key(entry["op"], entry["dtype"])) or factors.get(entry["op"])
    if not points:
        return 1.0
    size = entry["flops"] or entry["bytes"]
    last_size, last_factor = points[-1]
    if not entry["flops"] and size > last_size:
        return last_factor * memory_bandwidth(cal, size) / memory_bandwidth(cal, last_size)
    return _interpolated([(math.log(max(s, 1.0)), f) for s, f in points], math.log(max(size, 1.0)))


def op_seconds(
    entry: dict[str, Any], cal: Rates, *, on_gpu: bool, work_scale: float = 1.0, share: float = 1.0
) -> float:
    """One traced entry (``count`` identical calls) charged as the module docstring says; ``work_scale`` scales
    the work (FLOPs or bytes) of each call, never its dispatch cost. ``share``: a CPU rank's speed against the
    calibration's (``cpu_share``). More threads than calibrated do the work
    faster but not the dispatch, which is Python and autograd on one thread; less than a core slows both."""
    work = work_seconds(entry, cal, on_gpu=on_gpu) * operator_factor(cal, entry) * work_scale / share
    call = call_seconds(cal, share)
    return entry["count"] * (max(work, call) if on_gpu else work + call)


def call_seconds(cal: Rates, share: float = 1.0) -> float:
    """One operator call's host cost (``op_call_us``) on a rank of ``share`` (``host_share``)."""
    return (cal.op_call_us or 0.0) * 1e-6 / host_share(share)


def phase_seconds(
    ops: dict[str, list[dict[str, Any]]],
    cal: Rates,
    *,
    traced_world: int,
    world: int,
    sharded_step: bool,
    offload: str = "none",
    share: float = 1.0,
) -> dict[str, float]:
    """Seconds of compute per phase of one rank's step at ``world`` ranks.

    With offload on a GPU the optimizer step runs on the host, whose work the offload model charges (host AdamW,
    PCIe, NVMe; ``zbench.plan.simulate.step.offload_seconds``): its traced operators' work is left out here, not
    charged twice (on fake CPU tensors host and device operators cannot be told apart), but each of their calls
    is charged, as one host thread issues them. So the NVMe tier's step, one optimizer call per sub-group
    (``ZeroOptions.nvme_chunk_mb``), costs more in smaller sub-groups, as it does when run. On a CPU the host is
    the device: the traced operators are the host's own work (its AdamW, its copies into the host tier) and are
    charged as without offload, each at its factor inside a step; the offload model adds only NVMe's I/O.
    """
    on_gpu = cal.device != "cpu"  # "cpu" exactly where ``Cluster.on_cpu`` (``Cluster.operator_rates``)
    out = {}
    for phase, entries in ops.items():
        if phase == "after_backward" and offload != "none" and on_gpu:
            out[phase] = sum(e["count"] for e in entries) * call_seconds(cal, share)
            continue
        scale = traced_world / world if phase == "after_backward" and sharded_step else 1.0
        out[phase] = sum(op_seconds(e, cal, on_gpu=on_gpu, work_scale=scale, share=share) for e in entries)
    return out


def step_residual(cal: Rates, precision: str, charged_s: float) -> float:
    """What a step of ``charged_s`` operator seconds (at one thread) in ``precision`` takes over that charge
    (``Calibration.step_residuals``), between the probes' charges; 1 where the profile measured none."""
    return _by_charge(cal.step_residuals, precision, charged_s) or 1.0


def thread_speedup(cal: Calibration, precision: str, charged_s: float) -> float | None:
    """How much faster a step of ``charged_s`` operator seconds (at one thread) in ``precision`` runs on every core's
    threads than on one (``Calibration.thread_speedups``), between the probes' charges; a profile from before
    schema 8 gives its one figure for every dtype; ``None`` where none was measured (a GPU)."""
    return _by_charge(cal.thread_speedups, precision, charged_s) or cal.thread_speedup


def _by_charge(by_dtype: dict[str, list[tuple[float, float]]], precision: str, charged_s: float) -> float | None:
    """A per-dtype probe figure at ``charged_s``: linear in log charge between the probes, the nearest beyond them,
    fp32's for a dtype not probed; ``None`` where there is none."""
    points = by_dtype.get(dtype_name(COMPUTE_DTYPES[precision])) or by_dtype.get("float32")  # keyed as the probes'
    if not points:
        return None
    return _interpolated([(math.log(max(s, 1e-9)), r) for s, r in points], math.log(max(charged_s, 1e-9)))


def implementation_seconds(cal: Rates, implementation: str, stage: int, blocks: int, elements: int = 0) -> float:
    """The calibrated host work of ``implementation`` at ``stage`` beyond its operators, for a model of ``blocks``
    blocks and ``elements`` parameter elements, each of the unsharded model: FSDP2's copies around its collectives,
    the bulk of what grows with the elements, are of the whole parameters at any world size (0 where it was not
    measured: a GPU profile, a plug-in, an older calibration; never below 0)."""
    overhead = cal.overheads.get(overhead_key(implementation, stage))
    if overhead is None:
        return 0.0
    return max(0.0, (overhead.per_step_us + overhead.per_block_us * blocks + overhead.per_element_us * elements) * 1e-6)


def cpu_share(
    world: int, cores: int, threads_per_rank: int, thread_speedup: float | None = None, corun_slowdown: float = 1.0
) -> float:
    """A CPU rank's speed relative to the calibration's ``threads_per_rank``: the threads a CPU run gives each
    rank (``zbench.rank.worker``: ``$ZBENCH_THREADS_PER_RANK``, else ``cores // world``, at least one), and
    never more than ``cores / world`` cores each when ranks outnumber cores. More threads than calibrated gain
    what the calibration measured (``thread_speedup`` on every core; linear between), where it measured it:
    the 2-core machine's two threads ran an fp32 step of ``small`` 1.60-1.70 times as fast as one, a bf16 step
    1.24-1.30 times (2026-12-01), not twice.

    Ranks whose threads fill every core run ``corun_slowdown`` times slower on top (what the calibration's lone
    step lost with the other cores running it too, ``zbench.plan.calibrate.corun``): they share the caches, the
    memory bus and the host's time for its cores, which a lone rank had to itself. One rank on every core's threads
    is what ``thread_speedup`` measured, its loss already in."""
    threads = int(os.environ.get("ZBENCH_THREADS_PER_RANK", max(1, cores // world)))
    share = min(threads, cores / world) / threads_per_rank
    if world > 1 and world * threads >= cores:
        share /= corun_slowdown
    most = cores / threads_per_rank
    if thread_speedup is None or share <= 1 or most <= 1:
        return share
    return 1 + (thread_speedup - 1) * (share - 1) / (most - 1)


def corun_slowdown(cal: Calibration, precision: str, charged_s: float) -> float:
    """How much slower a step of ``charged_s`` operator seconds (at one thread) in ``precision`` ran while every
    other core ran it too (``Calibration.corun_slowdowns``), between the probes' charges; 1 where none was measured
    (a GPU, one core, a profile before schema 9)."""
    return _by_charge(cal.corun_slowdowns, precision, charged_s) or 1.0


def rank_share(cal: Rates, precision: str, world: int, charged_s: float, cores: int | None) -> float:
    """``cpu_share`` of a rank of ``world`` on ``cores`` CPU cores, at the thread speed-up and the co-run slow-down
    the calibration measured for ``precision`` at the rank's operator charge on one thread (``thread_speedup``,
    ``corun_slowdown``); 1 on a GPU profile, a datasheet's, or where no core count is given (``plan --simulate``
    charges a calibrated thread per rank)."""
    if cores is None or not isinstance(cal, Calibration) or cal.device != "cpu":
        return 1.0
    return cpu_share(world, cores, cal.threads_per_rank, thread_speedup(cal, precision, charged_s),
                     corun_slowdown(cal, precision, charged_s))  # fmt: skip


def case_phase_seconds(
    ops: dict[str, list[dict[str, Any]]], cal: Rates, case: Case, *, world: int, cores: int | None = None
) -> dict[str, float]:
    """``phase_seconds`` of one traced case at ``world`` ranks, its implementation's host work included.

    The operators' charge on one thread picks both figures the calibration measured by charge: the step residual
    and, on ``cores`` CPU cores, the thread speed-up that sets the rank's share (``rank_share``). The operators'
    work is charged at that share; the implementation's host work, Python on one thread, only slows where a rank
    has less than a core (``host_share``). On the 2-core machine's 48 runs of 2026-11-29
    (docs/data/validate_simulator_1129.json), dividing the host work by two threads' speed-up as well had put the
    step time's median error at 29.5% where this gives 25.7% (first profile)."""

    def charged(share: float) -> dict[str, float]:
        return phase_seconds(ops, cal, traced_world=case.world_size, world=world, sharded_step=case.stage >= 1,
                             offload=case.offload, share=share)  # fmt: skip

    one_thread = charged(1.0)
    charge = sum(one_thread.values())
    share = rank_share(cal, case.precision, world, charge, cores)
    residual = step_residual(cal, case.precision, charge)
    out = {phase: seconds * residual for phase, seconds in (one_thread if share == 1 else charged(share)).items()}
    info = model_info(case.model)
    out["after_backward"] = out.get("after_backward", 0.0) + implementation_seconds(
        cal, case.implementation, case.stage, len(info.block_sizes), info.parameters
    ) / host_share(share)
    return out
