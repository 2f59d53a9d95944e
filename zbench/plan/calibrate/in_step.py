"""Each operator's cost inside a training step, against what the calibration's tables charge it.

The tables time matrix products and two memory-bound operators (``copy``, ``add``) in isolation, on the same
buffers over and over. A training step is not that: GELU and log-softmax compute per element far more than an
``add`` does (on the 2-core machine, 2026-11-30, GELU's backward took 1.7-3.0 times what ``add``'s bandwidth
charged it), the optimizer's operators touch each tensor once per step, from memory rather than from a cache
still warm from the last repeat, and products run a few percent slower inside a step than alone. Measured on
profiled steps of ``small`` and ``medium`` at world 2 there, the operators the model charged 207 and 1,705 ms
took 299 and 2,028 ms (their own self time, profiler on).

So the calibration trains a probe model (a GPT of ``BLOCKS`` blocks at widths and token counts none of the
validation's presets use) for a few steps in a rank's environment, records one step's operators as the trace's
ledger does (``zbench.plan.trace.ops.OpLedger``), profiles the next identical steps (``PROFILED_STEPS``), and
keeps, for every operator call of one shape that does work enough to time, its factor: the median time the
profiler measured for it, less its calls' dispatch cost (``op_call_us``), over the work the tables charge it. The
step model multiplies each traced operator's work by its factor (``zbench.plan.simulate.compute.operator_factor``),
between the probed sizes by its size per call; an operator the probe does not run keeps factor 1. Operators nested
in another the ledger records (``_to_copy``'s ``copy_``) are that operator's time, as the ledger sees only the
outer call; composite operators the ledger never sees (``linear``) are transparent.

Why one factor per call shape, not per operator: the tables charge a call the bandwidth of its own working set,
cache-resident up to a few MiB, but the optimizer's operators find their tensors cold whatever their size (each
is touched once a step). One factor per operator, over a mix of calls at its mean size, charged ``medium``'s
AdamW (2026-11-30, the 2-core machine, one process): ``mul_`` on its 48 MB embedding calls 0.24 times the tables'
time where it took 0.62, on its 4.5 MB calls 1.22 where it took 2.1; its ``sqrt``, ``div``, ``mul_``,
``lerp_``, ``addcdiv_`` and ``addcmul_`` were charged 121 ms and took 212.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from zbench.plan.calibrate.corun import Siblings
from zbench.plan.simulate.calibration import Calibration, dtype_name, factor_key
from zbench.plan.trace.ops import OpLedger

#: (width, tokens per step) of the probe models: on a CPU two sizes that bracket a small and a mid-size block.
#: 1,024 tokens at width 1024 (2,048 before 2026-11-30 23:40: its steps of 4.5 s were a third of the calibration).
PROBES = ((384, 512), (1024, 1024))
QUICK_PROBES = ((256, 256),)
#: The reduced precision a CPU rank computes in under autocast (``zbench.implementations._common.autocast``),
#: probed once more at the first probe shape. Its operators' factors are kept under ``<op>:<dtype>``
#: (``compute.operator_factor`` looks there first): on the 2-core machine, 2026-11-30, the CPU's fused attention
#: took 0.7-0.9 times its charge in fp32 but 2-3.3 times it in bf16, and ``small``'s bf16 steps, charged with
#: the fp32 factors, were predicted a median 35% short where its fp32 steps were 20% short.
AUTOCAST_DTYPES = (torch.bfloat16,)
#: How much slower than the fp32 probe's step at its shape an autocast probe's step may be: past it the autocast
#: probe trains fewer sequences (at least one). Without bf16 instructions (a 2-core AMD EPYC, 2026-12-07) its bf16
#: step at 512 tokens took 4.4 s, ten times the fp32 one, and the probe 66 s of a 278-s calibration; where the
#: CPU has them the bf16 step is the faster and the probe keeps its tokens.
AUTOCAST_STEP_CAP = 2.0
BLOCKS, VOCAB, SEQ = 2, 4096, 128
#: Identical steps profiled per probe, each operator's time their median: one step's optimizer operators read
#: 1.4-1.8 times their charge in one calibration and 2.2-3.5 in the next (2026-11-30).
PROFILED_STEPS = 5
#: Unprofiled steps per probe timed whole, their median its step's wall time (``step_residuals``); each is paired
#: with a step on every core's threads, timed right after it (``thread_speedups``). At least ``WALL_STEPS`` pairs,
#: more until ``WALL_BUDGET_S`` has passed: three pairs of the width-384 probe (0.7 s a pair) read its speed-up at
#: 1.42-1.69 in five calibrations within 80 minutes on the 2-core machine (2026-12-07), which moved ``small``'s
#: predicted world-1 step by up to 19%. There, 33 pairs in a row read 1.35-1.84, median 1.76; four pairs in a
#: row during a 3-s spell read 1.35-1.44, and the medians of successive triples ranged 1.38-1.82. Eight seconds
#: (about 11 pairs) outvote such a spell; they did not narrow the spread between calibrations (five that afternoon
#: read 1.43-1.68: the host's second core comes and goes over minutes). A quick calibration takes the three.
WALL_STEPS = 3
WALL_BUDGET_S = 8.0
#: The residuals kept are clamped to this range: a probe step timed during a burst of other work is not the model.
RESIDUAL_RANGE = (0.8, 2.0)
#: An operator's charged work in one probe step below which its factor is not kept: its time is mostly dispatch,
#: which ``op_call_us`` already charges, and the profiler's own overhead.
MIN_WORK_S = 200e-6
#: The factors kept are clamped to this range: one outside it is a measurement gone wrong, not an operator.
FACTOR_RANGE = (0.1, 10.0)


def probe(
    quick: bool = False, threads: int = 1, progress: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """For each probe shape in fp32, then the first under autocast to each of ``AUTOCAST_DTYPES``: one step's ledger
    (``OpLedger.take``'s entries), each ledger operator's time in the next ``PROFILED_STEPS`` identical steps,
    their median (microseconds and calls, ``measured``), and the median of ``WALL_STEPS`` more, timed whole without
    the profiler (``wall_s``), each followed by one on ``threads`` threads (``speedup``: the median of the pairs'
    ratios, where ``threads`` > 1) and one on one thread while ``threads`` - 1 sibling processes run the same step
    on the other cores (``corun``: the median of its ratios to the lone step, ``zbench.plan.calibrate.corun``).
    Runs in a rank's environment (one thread, glibc's mmap threshold pinned:
    ``zbench.plan.calibrate.kernels.rank_probes``)."""
    shapes = QUICK_PROBES if quick else PROBES
    runs = [(width, tokens, torch.float32) for width, tokens in shapes]
    runs += [(*shapes[0], dtype) for dtype in AUTOCAST_DTYPES]
    wall_budget_s = 0.0 if quick else WALL_BUDGET_S
    out: list[dict[str, Any]] = []
    with Siblings(threads - 1, probe_step) as siblings:
        for i, (width, tokens, dtype) in enumerate(runs, 1):
            progress(f"step operators: width {width}, {tokens} tokens, {dtype_name(dtype)} "
                     f"({i}/{len(runs)})")  # fmt: skip
            cap = None if dtype == torch.float32 else AUTOCAST_STEP_CAP * out[0]["wall_s"]
            out.append(_probe_one(width, tokens, dtype, threads, siblings, max_step_s=cap,
                                  wall_budget_s=wall_budget_s))  # fmt: skip
    return out


def probe_model(width: int, dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
    """A training step of the probe model of ``width`` (seeded, so that every process builds the same) over a
    batch of token ids, under autocast to ``dtype`` unless it is float32."""
    from zbench.cases.models import GPT
    from zbench.presets import GPTConfig
    from zbench.protocol import TrainSpec

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=BLOCKS, d_model=width, heads=max(1, width // 64), vocab=VOCAB, seq=SEQ))
    optimizer = TrainSpec(device=torch.device("cpu"), weight_decay=0.01).make_optimizer(model.parameters())

    def train(ids: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train


def probe_step(width: int, sequences: int, dtype: torch.dtype) -> Callable[[], None]:
    """``probe_model``'s step over one fixed batch of ``sequences`` sequences (``on_batch``): what each co-running
    sibling runs (``zbench.plan.calibrate.corun``)."""
    return on_batch(probe_model(width, dtype), sequences)


def on_batch(train: Callable[[torch.Tensor], None], sequences: int) -> Callable[[], None]:
    """``train``'s step over one fixed batch of ``sequences`` random sequences, the batch drawn once: what the probe
    times, step after step."""
    ids = torch.randint(0, VOCAB, (sequences, SEQ + 1))
    return lambda: train(ids)


def _probe_one(
    width: int,
    tokens: int,
    dtype: torch.dtype,
    threads: int,
    siblings: Siblings,
    *,
    max_step_s: float | None,
    wall_budget_s: float,
) -> dict[str, Any]:
    """One probe model's step at ``tokens`` (fewer, at least one sequence, where a step would take over
    ``max_step_s``: ``sequences_within``), its wall steps paired for ``wall_budget_s`` (``_wall_steps``). The
    siblings build the same step while this one warms up; nothing is timed before they have."""
    train = probe_model(width, dtype)
    sequences = max(1, tokens // SEQ)
    if max_step_s is not None:
        sequences = sequences_within(train, sequences, max_step_s)
    siblings.build(width, sequences, dtype)
    step = on_batch(train, sequences)
    for _ in range(3):  # optimizer state, allocator caches
        step()
    siblings.wait_built()
    ledger = OpLedger()
    with ledger:
        ledger.start_step()
        step()
        entries = [e for phase in ledger.take().values() for e in phase]
    recorded = {e["op"] for e in entries}
    profiled = []
    for _ in range(PROFILED_STEPS):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        profiled.append(claimed_times(prof.events(), recorded))
    measured = {
        key: (statistics.median(p[key][0] for p in profiled if key in p), calls)
        for key, (_, calls) in profiled[0].items()
    }
    walls = _wall_steps(step, threads, wall_budget_s, siblings=siblings)
    out = {"width": width, "tokens": sequences * SEQ, "dtype": dtype_name(dtype), "entries": entries,
           "measured": measured, "wall_s": statistics.median(walls.alone)}  # fmt: skip
    if walls.speedups:
        out.update(threads=threads, speedup=statistics.median(walls.speedups))
    if walls.slowdowns:
        out["corun"] = statistics.median(walls.slowdowns)
    return out


def sequences_within(train: Callable[[torch.Tensor], None], sequences: int, max_step_s: float) -> int:
    """How many sequences (at most ``sequences``, at least one) a step of ``train`` runs within ``max_step_s``, read
    off one timed step of a single sequence after an untimed one (the optimizer's state is created there)."""
    one = torch.randint(0, VOCAB, (1, SEQ + 1))
    train(one)
    per_sequence = _timed(lambda: train(one))
    return max(1, min(sequences, int(max_step_s / per_sequence)))


class WallSteps(NamedTuple):
    """A probe's steps timed whole (``_wall_steps``)."""

    alone: list[float]
    """One thread's steps, alone on the host."""
    speedups: list[float]
    """Each lone step over one on every core's threads timed right after it; none on one core."""
    slowdowns: list[float]
    """One thread's step while siblings run it on every other core, over the lone step before it; none without
    siblings."""


def _wall_steps(
    step: Callable[[], None],
    threads: int,
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
    siblings: Siblings | None = None,
) -> WallSteps:
    """At least ``WALL_STEPS`` rounds, more until ``budget_s`` has passed, each a step on one thread timed whole,
    then where ``threads`` > 1 one on ``threads`` threads, then where ``siblings`` are at hand one on one thread
    while they run it too; each later step's time taken against the lone one's of its round. Paired round by round,
    as a burst of other work or the host's drift (up to 1.6 times within seconds on the 2-core machine, 2026-12-01)
    moves every step of a round alike."""
    out = WallSteps([], [], [])
    before = torch.get_num_threads()
    started = clock()
    try:
        while len(out.alone) < WALL_STEPS or clock() - started < budget_s:
            torch.set_num_threads(1)
            one = _timed(step)
            out.alone.append(one)
            if threads > 1:
                torch.set_num_threads(threads)
                out.speedups.append(one / _timed(step))
                torch.set_num_threads(1)
            if siblings is not None and siblings.active:
                with siblings.running():
                    out.slowdowns.append(_timed(step) / one)
    finally:
        torch.set_num_threads(before)
    return out


def _timed(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def call_key(op: str, shapes: Any) -> str:
    """How a ledger entry and a profiled call are matched: the operator and its tensors' shapes, empty shapes left
    out on both sides (the profiler lists a scalar argument, a 0-dim tensor and a tensor list each as an empty
    shape). So ``cat`` of a list keys by its name alone, and ``mul_`` by a tensor and a 0-dim scale by the tensor."""
    dims = ",".join("x".join(map(str, s)) for s in shapes if len(s))
    return f"{op}|{dims}"


def claimed_times(events: Any, recorded: set[str]) -> dict[str, tuple[float, int]]:
    """``{call_key: (microseconds, calls)}``: each profiled call of an operator the ledger records (``aten::<op>``),
    its time including what it called, unless an enclosing call already claimed it (the ledger sees the outer call
    only); by operator and shapes where the profile recorded shapes, else by operator alone (``call_key(op, ())``)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def walk(event: Any) -> None:
        name = event.name.removeprefix("aten::")
        if event.name.startswith("aten::") and name in recorded:
            key = call_key(name, event.input_shapes or ())
            out[key][0] += event.cpu_time_total
            out[key][1] += 1
            return
        for child in event.cpu_children:
            walk(child)

    for event in events:
        if event.cpu_parent is None:
            walk(event)
    return {op: (us, int(calls)) for op, (us, calls) in out.items()}


def factors(probes: list[dict[str, Any]], cal: Calibration) -> dict[str, list[tuple[float, float]]]:
    """``{op: [(size per call, factor), ...]}`` by increasing size (FLOPs for an operator that has them, else
    bytes moved): each call shape's measured time less its calls' dispatch cost, over the work ``cal``'s tables
    charge it (``_call_groups``); calls of one size, from any probe, pooled into one point.

    A probe under autocast (``dtype`` other than float32) adds ``<op>:<dtype>`` for each call shape that ran only in
    that dtype there; the others (the optimizer's, layer norm) keep the fp32 probes' factor."""
    pooled: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for p in probes:
        probe_dtype = p.get("dtype", "float32")  # probes recorded before autocast was probed: fp32
        for op, dtypes, size, work, seconds in _call_groups(p, cal):
            if probe_dtype != "float32" and dtypes != {probe_dtype}:
                continue
            point = pooled[factor_key(op, probe_dtype)][size]
            point[0] += work
            point[1] += seconds
    return {
        key: sorted(
            (size, min(max(seconds / work, FACTOR_RANGE[0]), FACTOR_RANGE[1]))
            for size, (work, seconds) in by_size.items()
        )
        for key, by_size in sorted(pooled.items())
        if all(math.isfinite(seconds / work) for work, seconds in by_size.values())
    }


class CallGroup(NamedTuple):
    """Calls of one operator timed together in a probe step."""

    op: str
    dtypes: set[str]
    size: float
    """Per call: FLOPs where the operator has them, else bytes moved."""
    work_s: float
    """What the tables charge the group's calls."""
    measured_s: float
    """Their profiled time less their calls' dispatch cost (``op_call_us``)."""


@dataclass
class _Pool:
    """An operator's calls too small to time alone or that the profiler cannot tell apart, summed."""

    work_s: float = 0.0
    sized: float = 0.0
    """Size per call times calls, summed: the pool's mean size times its calls."""
    calls: int = 0
    measured_us: float = 0.0
    dtypes: set[str] = field(default_factory=set)


def _call_groups(probe: dict[str, Any], cal: Calibration) -> list[CallGroup]:
    """Each group of a probe's calls timed together: each call shape the profiler matched to the ledger
    (``call_key``) with ``MIN_WORK_S`` of work, and per operator the rest pooled at their mean size (shapes the
    profiler cannot tell apart, calls too small to time alone), kept if the pool does that much work."""
    from zbench.plan.simulate.compute import call_seconds, work_seconds

    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in probe["entries"]:
        by_key[call_key(e["op"], e["shapes"])].append(e)
    measured = probe["measured"]
    pools: dict[str, _Pool] = defaultdict(_Pool)
    groups = []
    for key, entries in by_key.items():
        op = entries[0]["op"]
        work = sum(work_seconds(e, cal, on_gpu=False) * e["count"] for e in entries)
        calls = sum(e["count"] for e in entries)
        sized = sum((e["flops"] or e["bytes"]) * e["count"] for e in entries)
        dtypes = {e["dtype"] for e in entries}
        timed = measured.get(key)
        if timed is not None and timed[1] == calls and work >= MIN_WORK_S:
            groups.append(CallGroup(op, dtypes, sized / calls, work, timed[0] * 1e-6 - calls * call_seconds(cal)))
            continue
        pool = pools[op]
        pool.work_s, pool.sized, pool.calls = pool.work_s + work, pool.sized + sized, pool.calls + calls
        pool.measured_us += timed[0] if timed is not None else 0.0
        pool.dtypes |= dtypes
    for key, (us, _) in measured.items():  # calls the profiler could not tell apart by shape: their operator's pool
        op = key.split("|", 1)[0]
        if key not in by_key and op in pools:
            pools[op].measured_us += us
    for op, pool in pools.items():
        if pool.work_s >= MIN_WORK_S and pool.measured_us > 0:
            seconds = pool.measured_us * 1e-6 - pool.calls * call_seconds(cal)
            groups.append(CallGroup(op, pool.dtypes, pool.sized / pool.calls, pool.work_s, seconds))
    return groups


def step_residuals(probes: list[dict[str, Any]], cal: Calibration) -> dict[str, list[tuple[float, float]]]:
    """``{dtype: [(charged s, residual), ...]}`` by increasing charge: each probe step's unprofiled wall time over
    what ``cal`` (its factors already in) charges its operators, ``compute.op_seconds`` at one thread. What it
    holds is the step's time outside the operators the ledger records: the autograd engine between them, the
    optimizer's Python loop, freeing tensors. On the 2-core machine (2026-11-30, one thread) the model charged
    ``small``'s bare step 184 ms where it took 204 (``medium``: 1,576 against 1,614; in bf16 134 against 162 and
    1,030 against 1,172) and the probe models read the same: 8.4% and 4.0% over in fp32, 24% in bf16. Probes
    recorded before the wall time was: none."""
    return _by_charge(
        [p for p in probes if "wall_s" in p], cal,
        lambda p, charged: min(max(p["wall_s"] / charged, RESIDUAL_RANGE[0]), RESIDUAL_RANGE[1]),
    )  # fmt: skip


def thread_speedups(probes: list[dict[str, Any]], cal: Calibration) -> dict[str, list[tuple[float, float]]]:
    """``{dtype: [(charged s, speed-up), ...]}`` by increasing charge: how much faster each probe's step ran on every
    core's threads than on one (``_wall_steps``), what a CPU rank with the cores to itself gains
    (``zbench.plan.simulate.compute.cpu_share``). Per dtype, as the gain is the dtype's: on the 2-core machine
    (2026-12-01, two reads each) fp32 steps of ``small`` and ``medium`` ran 1.60-1.70 and 1.68-1.76 times as fast
    on two threads, bf16 steps 1.24-1.30 and 1.26-1.48, where the one figure calibrate took before (a transformer
    MLP's fp32 step) read 1.42-1.51 for both. Probes from a one-core machine or recorded before the pairs were:
    none."""
    return _by_charge([p for p in probes if "speedup" in p], cal, lambda p, _: p["speedup"])


def corun_slowdowns(probes: list[dict[str, Any]], cal: Calibration) -> dict[str, list[tuple[float, float]]]:
    """``{dtype: [(charged s, slow-down), ...]}`` by increasing charge: how much longer each probe's one-thread step
    took while sibling processes ran it on every other core than alone (``_wall_steps``), what a CPU rank whose
    world fills the cores loses to the others (``zbench.plan.simulate.compute.cpu_share``). Probes from a one-core
    machine or recorded before the siblings were: none."""
    return _by_charge([p for p in probes if "corun" in p], cal, lambda p, _: p["corun"])


def _by_charge(
    probes: list[dict[str, Any]], cal: Calibration, value: Callable[[dict[str, Any], float], float]
) -> dict[str, list[tuple[float, float]]]:
    """``{dtype: [(charged s, value(probe, charged)), ...]}`` by increasing charge, each probe's charge what ``cal``
    charges its operators at one thread (``compute.op_seconds``)."""
    from zbench.plan.simulate.compute import op_seconds

    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for p in probes:
        charged = sum(op_seconds(e, cal, on_gpu=False) for e in p["entries"])
        if charged > 0:
            out[p.get("dtype", "float32")].append((charged, value(p, charged)))
    return {dtype: sorted(points) for dtype, points in sorted(out.items())}
