"""Operators inside a training step (``zbench.plan.calibrate.in_step``): the profiled time each recorded operator
claims, the factor it is given over the tables' charge, and the step model charging it."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from zbench.plan.calibrate import in_step
from zbench.plan.simulate.calibration import BandwidthPoint, Calibration, MatmulPoint
from zbench.plan.simulate.compute import memory_bandwidth, op_seconds, operator_factor, phase_seconds, work_seconds


def calibration(**extra: object) -> Calibration:
    """A CPU calibration with flat tables: 10 GB/s at every working set, 100 GFLOP/s, 5 us per call."""
    return Calibration(
        measured_at="2026-11-30T00:00:00+00:00", host="h", torch="t", zbench="z", device="cpu", backend="gloo",
        ranks=1, threads_per_rank=1, seconds=1.0,
        matmul=[MatmulPoint(m=64, k=64, n=64, dtype="float32", tflops=0.1)],
        memory_bound=[BandwidthPoint(op="copy", bytes=2**20, gb_s=10.0)],
        collectives=[], hook_call_us=1.0, op_call_us=5.0, copies_gb_s={}, host_adam_params_per_s=1e8, **extra,
    )  # fmt: skip


def memory_bandwidth_at(cal: Calibration, moved: int) -> float:
    return memory_bandwidth(cal, moved) / 1e9


def entry(op: str, nbytes: int, count: int = 1, flops: int = 0, dtype: str = "float32", shapes=()) -> dict:
    return {"op": op, "dtype": dtype, "shapes": [list(s) for s in shapes], "flops": flops, "bytes": nbytes,
            "mapped_bytes": 0, "count": count}  # fmt: skip


def timed(e: dict, factor: float, cal: Calibration) -> tuple[float, int]:
    """What the profiler would claim for ``e``'s calls if each took ``factor`` times its charged work plus dispatch."""
    return e["count"] * (factor * work_seconds(e, cal, on_gpu=False) + 5e-6) * 1e6, e["count"]


def profiled(fn) -> list:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return prof.events()


def ops(claimed: dict) -> set[str]:
    return {key.split("|")[0] for key in claimed}


def test_a_nested_call_is_the_time_of_the_outer_operator_the_ledger_records():
    """The ledger sees ``_to_copy``, not the ``copy_`` inside it, and ``addmm``, not the ``linear`` around it:
    each profiled call is claimed by the outermost operator the ledger records."""
    x, w, b = torch.randn(64, 32), torch.randn(16, 32), torch.randn(16)
    events = profiled(lambda: (x.to(torch.float64), torch.nn.functional.linear(x, w, b)))
    claimed = in_step.claimed_times(events, {"_to_copy", "copy_", "addmm"})
    assert ops(claimed) == {"_to_copy", "addmm"} and all(calls == 1 for _, calls in claimed.values())
    assert in_step.call_key("_to_copy", [[64, 32]]) in claimed  # keyed by shape, as the ledger's entries are
    converted = profiled(lambda: x.to(torch.float64))
    alone = in_step.claimed_times(converted, {"copy_"})  # with _to_copy not recorded, its copy_ is its own
    assert ops(alone) == {"copy_"}
    whole = in_step.claimed_times(converted, {"_to_copy", "copy_"})
    assert sum(us for us, _ in whole.values()) >= sum(us for us, _ in alone.values())  # includes the copy it made


def test_a_call_is_matched_to_its_ledger_entry_by_its_tensors_shapes():
    """The ledger's ``mul_(t, 0-dim scale)`` and the profiler's (which lists the scale, like any scalar, as an empty
    shape) get one key; two shapes of one operator get two."""
    a, b, scale = torch.randn(8, 4), torch.randn(3, 5), torch.tensor(2.0)
    claimed = in_step.claimed_times(profiled(lambda: (a.mul_(scale), b.mul_(scale), b.mul_(3.0))), {"mul_"})
    assert claimed.keys() == {in_step.call_key("mul_", [[8, 4], []]), in_step.call_key("mul_", [[3, 5]])}
    assert claimed[in_step.call_key("mul_", [[3, 5]])][1] == 2


def test_a_factor_is_the_measured_time_less_dispatch_over_the_charged_work():
    cal = calibration()
    gelu = entry("gelu", 10 * 2**20, count=4)  # 1.05 ms of work at 10 GB/s, each of 4 calls
    work = work_seconds(gelu, cal, on_gpu=False)
    slow = 4 * (2.5 * work + 5e-6) * 1e6  # measured: 2.5 times the work, plus each call's dispatch
    tiny = entry("fill_", 100, count=3)  # charged far less than MIN_WORK_S: dispatch, not work
    probes = [{"entries": [gelu, tiny], "measured": {"gelu|": (slow, 4), "fill_|": (900.0, 3)}}]
    factors = in_step.factors(probes, cal)
    assert set(factors) == {"gelu"}
    ((size, factor),) = factors["gelu"]
    assert size == 10 * 2**20 and factor == pytest.approx(2.5)
    wild = [{"entries": [gelu], "measured": {"gelu|": (slow * 100, 4)}}]  # a measurement gone wrong is clamped
    assert in_step.factors(wild, cal)["gelu"][0][1] == in_step.FACTOR_RANGE[1]


def test_each_call_shape_gets_its_own_factor_and_what_cannot_be_told_apart_is_pooled():
    """AdamW touches each tensor once a step, from memory, while the tables charge a small tensor a cache's rate:
    its small calls run several times their charge, its large ones about theirs. One factor per operator, at the
    calls' mean size, would charge both wrong; one per shape keeps each. Calls whose shapes the profiler does not
    record (a tensor list) and calls too small to time alone are pooled per operator at their mean size."""
    cal = calibration()
    small = entry("mul_", 2 * 2**20, count=8, shapes=[(512, 512)])
    large = entry("mul_", 64 * 2**20, count=2, shapes=[(4096, 2048)])
    cat1 = entry("cat", 4 * 2**20, count=2, shapes=[(256, 1024), (256, 1024)])
    cat2 = entry("cat", 16 * 2**20, count=2, shapes=[(1024, 1024), (1024, 1024)])
    cat_time = (timed(cat1, 1.5, cal)[0] + timed(cat2, 1.5, cal)[0], 4)  # the profiler sees one key: "cat|"
    measured = {in_step.call_key("mul_", small["shapes"]): timed(small, 2.0, cal),
                in_step.call_key("mul_", large["shapes"]): timed(large, 0.7, cal), "cat|": cat_time}  # fmt: skip
    factors = in_step.factors([{"entries": [small, large, cat1, cat2], "measured": measured}], cal)
    assert factors["mul_"] == [(2 * 2**20, pytest.approx(2.0)), (64 * 2**20, pytest.approx(0.7))]
    assert factors["cat"] == [(10 * 2**20, pytest.approx(1.5))]  # pooled at the mean size
    miscounted = {**measured, in_step.call_key("mul_", large["shapes"]): (timed(large, 0.7, cal)[0], 3)}
    pooled = in_step.factors([{"entries": [small, large], "measured": miscounted}], cal)["mul_"]
    assert pooled[0] == (2 * 2**20, pytest.approx(2.0)) and pooled[1][0] == 64 * 2**20  # its calls uncounted: rest


def test_the_step_model_multiplies_an_operators_work_by_its_factor_between_probe_sizes():
    cal = calibration(operator_factors={"gelu": [(2**20, 2.0), (2**24, 4.0)]})
    plain = calibration()
    call = 5e-6
    for nbytes, factor in ((2**20, 2.0), (2**22, 3.0), (2**24, 4.0), (2**10, 2.0), (2**30, 4.0)):
        e = entry("gelu", nbytes, count=3)
        assert operator_factor(cal, e) == pytest.approx(factor)
        assert op_seconds(e, cal, on_gpu=False) - 3 * call == pytest.approx(
            factor * (op_seconds(e, plain, on_gpu=False) - 3 * call)
        )  # the work scaled, the dispatch not
    other = entry("add", 2**22)
    assert operator_factor(cal, other) == 1.0 and op_seconds(other, cal, on_gpu=False) == op_seconds(
        other, plain, on_gpu=False
    )
    # past the largest probe a memory-bound operator keeps the rate it ran at there: where the tables' rate halves
    # (a working set out of the caches), its factor halves with it rather than charging the fall twice
    table = [BandwidthPoint(op="copy", bytes=2**20, gb_s=20.0), BandwidthPoint(op="copy", bytes=2**26, gb_s=10.0)]
    falling = calibration(operator_factors={"lerp_": [(2**20, 2.0), (2**22, 1.5)]}).model_copy(
        update={"memory_bound": table}
    )
    big = entry("lerp_", 2**27 * 2)  # copy's points are per input byte: 2 moved per byte
    assert operator_factor(falling, big) == pytest.approx(1.5 * 10.0 / memory_bandwidth_at(falling, 2**22))
    mm = entry("mm", 0, flops=2 * 64**3)  # a product's size is its FLOPs
    assert operator_factor(calibration(operator_factors={"mm": [(2 * 64**3, 1.2)]}), mm) == pytest.approx(1.2)


def test_an_autocast_probe_keeps_factors_only_for_operators_that_ran_in_its_dtype_alone():
    """Under autocast the products and GELU run in bf16, the optimizer in fp32, and a reduction may see both: only
    the first get ``<op>:bfloat16``; the others keep the fp32 probe's factor, never one learned from a mix."""
    cal = calibration()

    def measured(*entries: dict, factor: float) -> dict:
        return {in_step.call_key(e["op"], e["shapes"]): timed(e, factor, cal) for e in entries}

    gelu32, lerp32 = entry("gelu", 2**22, count=2), entry("lerp_", 2**22, count=2)
    gelu16, lerp16 = entry("gelu", 2**21, count=2, dtype="bfloat16"), entry("lerp_", 2**22, count=2)
    sum16, sum32 = entry("sum", 2**22, dtype="bfloat16"), entry("sum", 2**22)
    fp32 = {"dtype": "float32", "entries": [gelu32, lerp32], "measured": measured(gelu32, lerp32, factor=1.5)}
    bf16 = {"dtype": "bfloat16", "entries": [gelu16, lerp16, sum16, sum32],
            "measured": measured(gelu16, lerp16, sum16, factor=4.0)}  # fmt: skip
    factors = in_step.factors([fp32, bf16], cal)
    assert set(factors) == {"gelu", "lerp_", "gelu:bfloat16"}
    assert factors["gelu"][0][1] == pytest.approx(1.5) and factors["lerp_"][0][1] == pytest.approx(1.5)
    assert factors["gelu:bfloat16"][0][1] == pytest.approx(4.0)
    legacy = {k: v for k, v in fp32.items() if k != "dtype"}  # a probe stored before autocast was probed: fp32
    assert in_step.factors([legacy], cal) == in_step.factors([fp32], cal)


def test_an_operator_takes_its_dtypes_factor_and_else_the_fp32_one():
    cal = calibration(operator_factors={"gelu": [(2**20, 1.5)], "gelu:bfloat16": [(2**20, 4.0)], "mm": [(1, 1.2)]})
    assert operator_factor(cal, entry("gelu", 2**20, dtype="bfloat16")) == pytest.approx(4.0)
    assert operator_factor(cal, entry("gelu", 2**20)) == pytest.approx(1.5)  # fp32 never takes bf16's
    assert operator_factor(cal, entry("gelu", 2**20, dtype="float16")) == pytest.approx(1.5)  # not probed: fp32's
    assert operator_factor(cal, entry("mm", 0, flops=10, dtype="bfloat16")) == pytest.approx(1.2)


def test_a_probe_step_times_the_operators_a_transformer_step_runs():
    """The quick probes, for real: GELU, the products and the optimizer's operators are timed, each factor within
    the clamp, in fp32 and again under bf16 autocast, where the products and GELU get factors of their own."""
    cal = calibration()
    threads_before = torch.get_num_threads()
    fp32, bf16 = in_step.probe(quick=True, threads=2)
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert {"gelu", "gelu_backward", "addmm", "mm", "lerp_"} <= ops(fp32["measured"])
    ledger = {in_step.call_key(e["op"], e["shapes"]) for e in fp32["entries"] if e["op"] in {"addmm", "lerp_"}}
    assert ledger and ledger <= set(fp32["measured"])  # every call shape of these matched to its ledger entry
    assert {e["dtype"] for e in bf16["entries"] if e["op"] == "addmm"} == {"bfloat16"}
    factors = in_step.factors([fp32, bf16], cal)
    assert {"gelu", "addmm", "mm", "addmm:bfloat16"} <= set(factors)
    assert "lerp_:bfloat16" not in factors  # the optimizer steps fp32 parameters under autocast too
    low, high = in_step.FACTOR_RANGE
    assert all(low <= f <= high for points in factors.values() for _, f in points)
    assert fp32["wall_s"] > 0 and bf16["wall_s"] > 0  # each probe's step timed whole, without the profiler
    assert set(in_step.step_residuals([fp32, bf16], cal)) == {"float32", "bfloat16"}
    assert fp32["threads"] == 2 and fp32["speedup"] > 0 and bf16["speedup"] > 0  # each paired with two threads'
    assert set(in_step.thread_speedups([fp32, bf16], cal)) == {"float32", "bfloat16"}
    assert fp32["corun"] > 0 and bf16["corun"] > 0  # and with a sibling process running it on the other core
    assert set(in_step.corun_slowdowns([fp32, bf16], cal)) == {"float32", "bfloat16"}
    assert torch.get_num_threads() == threads_before  # the pairs' thread count put back


def test_each_wall_step_is_paired_with_one_on_every_cores_threads_right_after_it(monkeypatch):
    """The speed-up is the median of each one-thread step over the all-threads step timed right after it: the host's
    drift between pairs (1.6x within seconds on the 2-core machine) moves both steps of a pair alike. A burst through
    one step (the third pair's two-thread step) costs one pair's ratio, which the median outvotes. Planted bug this
    catches: the steps timed as all one-thread ones, then all two-thread ones (the drift, arriving between the
    two runs, halves the read speed-up)."""
    quiet = {1: 0.100, 2: 0.060}
    drift = iter([1.0, 1.0, 1.6, 1.6, 1.6, 1.6 * 3])
    order = []

    def timed(step):
        order.append(torch.get_num_threads())
        return quiet[order[-1]] * next(drift)

    monkeypatch.setattr(in_step, "_timed", timed)
    walls, speedups, _ = in_step._wall_steps(lambda: None, threads=2, budget_s=0.0)
    assert order == [1, 2] * in_step.WALL_STEPS
    assert statistics.median(speedups) == pytest.approx(0.100 / 0.060)
    assert walls == pytest.approx([0.100, 0.160, 0.160])
    order.clear()
    monkeypatch.setattr(in_step, "_timed", lambda step: order.append(torch.get_num_threads()) or 0.1)
    walls, speedups, slowdowns = in_step._wall_steps(lambda: None, threads=1, budget_s=0.0)
    assert (walls, speedups, slowdowns) == ([0.1] * in_step.WALL_STEPS, [], [])  # one core: no pairs
    assert order == [1] * in_step.WALL_STEPS


class FakeSiblings:
    """Stands in for ``corun.Siblings``: records when its block runs, so that a test can slow the steps inside it."""

    active = True

    def __init__(self) -> None:
        self.inside = False
        self.blocks = 0

    @contextlib.contextmanager
    def running(self):
        self.inside, self.blocks = True, self.blocks + 1
        try:
            yield
        finally:
            self.inside = False


def test_each_round_times_a_step_beside_siblings_against_the_lone_step_of_its_round(monkeypatch):
    """The co-run slow-down is each one-thread step timed while the siblings run, over the lone one-thread step of
    its round, never over the two-thread step just before it; drift between rounds cancels within each.
    Planted bugs this catches: the slow-down taken against the two-thread step (reads 1.15 / 0.6 = 1.92 here, not
    1.15), the step beside the siblings timed on two threads, a round without the siblings' block."""
    quiet = {1: 0.100, 2: 0.060}
    drift = iter([1.0] * 3 + [1.6] * 3 + [2.0] * 3)
    siblings = FakeSiblings()
    order = []

    def timed(step):
        threads = torch.get_num_threads()
        order.append((threads, siblings.inside))
        return quiet[threads] * next(drift) * (1.15 if siblings.inside else 1.0)

    monkeypatch.setattr(in_step, "_timed", timed)
    rounds = in_step._wall_steps(lambda: None, threads=2, budget_s=0.0, siblings=siblings)
    assert order == [(1, False), (2, False), (1, True)] * in_step.WALL_STEPS
    assert rounds.slowdowns == pytest.approx([1.15] * in_step.WALL_STEPS)
    assert rounds.alone == pytest.approx([0.100, 0.160, 0.200]) and siblings.blocks == in_step.WALL_STEPS
    assert rounds.speedups == pytest.approx([0.100 / 0.060] * in_step.WALL_STEPS)


def test_a_co_run_slow_down_is_kept_by_dtype_at_each_probes_charge():
    """Each probe that ran beside siblings gives ``(charged s, slow-down)`` under its dtype; one that did not (a
    one-core host, a profile from before schema 9) gives none, and the step model then slows nothing."""
    from zbench.plan.simulate.compute import corun_slowdown, rank_share

    cal = calibration()
    adds = [entry("add", 2**20, count=100)]
    probes = [
        {"dtype": "float32", "entries": adds, "wall_s": 1.0, "corun": 1.2},
        {"dtype": "float32", "entries": adds * 3, "wall_s": 3.0, "corun": 1.05},
        {"dtype": "bfloat16", "entries": adds, "wall_s": 1.0},
    ]
    points = in_step.corun_slowdowns(probes, cal)
    assert list(points) == ["float32"] and [value for _, value in points["float32"]] == [1.2, 1.05]
    cal = calibration(corun_slowdowns=points)
    low, high = (charge for charge, _ in points["float32"])
    assert corun_slowdown(cal, "fp32", low) == pytest.approx(1.2)
    assert corun_slowdown(cal, "fp32", (low * high) ** 0.5) == pytest.approx(1.125)  # linear in log charge
    assert corun_slowdown(cal, "bf16", high * 10) == pytest.approx(1.05)  # not probed: fp32's, the nearest beyond
    assert corun_slowdown(calibration(), "fp32", low) == 1.0
    # a world-2 rank on the 2 cores runs at its slow-down, a world-1 rank at its speed-up alone
    cal = calibration(corun_slowdowns=points, thread_speedups={"float32": [(low, 1.6)]})
    assert rank_share(cal, "fp32", 2, low, cores=2) == pytest.approx(1 / 1.2)
    assert rank_share(cal, "fp32", 1, low, cores=2) == pytest.approx(1.6)


def test_siblings_run_the_probe_step_only_inside_their_block_and_a_failure_is_one_line():
    """Real sibling processes: each builds the probe's step, burns CPU while ``running()``'s block runs and none
    after it (the next lone step is timed alone); a sibling that cannot build says why in one line. Planted bugs
    this catches: a sibling still stepping after the block, one that never starts, an error that hangs."""
    from zbench.errors import OneLineError
    from zbench.plan.calibrate.corun import Siblings

    def cpu_seconds(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    if not Path("/proc/self/stat").exists():
        pytest.skip("reads a process's CPU time from /proc")
    with Siblings(1, in_step.probe_step) as siblings:
        assert siblings.active
        siblings.build(64, 1, torch.float32)
        siblings.wait_built()
        (pid,) = [p.pid for p in siblings._processes]
        before = cpu_seconds(pid)
        with siblings.running():
            time.sleep(1.0)
        during = cpu_seconds(pid) - before
        time.sleep(1.0)
        after = cpu_seconds(pid) - before - during
        assert during > 0.3 and after < 0.1, (during, after)
        siblings.build(-64, 1, torch.float32)  # a model of negative width cannot be built
        with pytest.raises(OneLineError, match="co-running probe process failed: "):
            siblings.wait_built()
    assert not Siblings(0, in_step.probe_step).active  # a one-core host: no processes


def test_wall_steps_pair_on_until_their_budget_has_passed_and_a_slow_probe_keeps_its_minimum(monkeypatch):
    """Pairs go on until the budget's seconds have passed (a probe step under a second gets several pairs, so that
    one pair's burst moves the median less), but a probe whose steps take seconds stops at ``WALL_STEPS`` pairs
    rather than a budget's worth of minutes. Planted bugs this catches: a fixed count (three pairs of the fast
    probe), or a budget that cuts the minimum (one pair of the slow probe)."""
    now = [0.0]

    def run_with(step_s: float) -> list[float]:
        now[0] = 0.0

        def timed(step):
            seconds = step_s / torch.get_num_threads() ** 0.5
            now[0] += seconds
            return seconds

        monkeypatch.setattr(in_step, "_timed", timed)
        return in_step._wall_steps(lambda: None, threads=2, budget_s=4.0, clock=lambda: now[0]).speedups

    fast = run_with(0.4)  # a pair takes 0.4 + 0.28 s: 4 s hold 6 pairs
    assert len(fast) == 6 and now[0] >= 4.0
    assert statistics.median(fast) == pytest.approx(2**0.5)
    slow = run_with(3.0)  # a pair takes 5.1 s
    assert len(slow) == in_step.WALL_STEPS


def test_an_autocast_probe_trains_as_many_sequences_as_fit_its_step_cap(monkeypatch):
    """Read off one timed single-sequence step: a dtype that runs at fp32's speed keeps every sequence, one whose
    sequence alone takes longer than the cap (bf16 without bf16 instructions: ten times fp32's step) trains one, never
    none. Planted bugs this catches: the cap ignored (four sequences at 1.1 s each), or rounded to zero sequences."""
    calls = []
    train = calls.append
    for per_sequence, cap, expected in ((0.1, 0.9, 4), (0.3, 0.9, 3), (1.1, 0.9, 1)):
        monkeypatch.setattr(in_step, "_timed", lambda fn, s=per_sequence: fn() or s)
        calls.clear()
        assert in_step.sequences_within(train, 4, cap) == expected
        assert len(calls) == 2 and all(ids.shape == (1, in_step.SEQ + 1) for ids in calls)  # one untimed, one timed


def test_a_cases_thread_speed_up_is_its_dtypes_at_its_operators_charge_on_one_thread():
    """A world-1 rank with both cores gains its dtype's measured speed-up (fp32 steps of ``small`` ran 1.60-1.70x on
    two threads, bf16 ones 1.24-1.30x, on the 2-core machine, 2026-12-01), between the probes by its charge at one
    thread, fp32's for a dtype not probed; a profile from before schema 8 gives its one figure to every dtype; ranks
    with a core each or less gain nothing. Planted bugs this catches: fp32's speed-up given to a bf16 case, the
    charge looked up at two threads' speed."""
    from zbench.plan.simulate.compute import case_phase_seconds, rank_share, thread_speedup
    from zbench.plan.trace.plan import make_case

    points = {"float32": [(0.1, 1.8), (1.0, 1.6)], "bfloat16": [(0.1, 1.3)]}
    cal = calibration(thread_speedups=points)
    assert thread_speedup(cal, "fp32", 0.1**0.5) == pytest.approx(1.7) and thread_speedup(cal, "fp16", 9) == 1.6
    assert thread_speedup(calibration(thread_speedup=1.5), "bf16", 1.0) == 1.5  # before schema 8
    assert thread_speedup(calibration(), "fp32", 1.0) is None

    add = entry("add", 2**20, count=1000)  # 0.11 s at one thread: just above the first probe's charge
    charged = phase_seconds({"backward": [add]}, cal, traced_world=1, world=1, sharded_step=False)["backward"]
    assert charged == pytest.approx(0.11, rel=0.05)

    def share(precision: str, world: int = 1) -> float:
        """The share ``case_phase_seconds`` charged a case's operators at, read back off its phases."""
        case = make_case("small", "ddp", 0, "none", gpus=world, precision=precision, micro_batch=2, seq_len=64,
                         device="cpu", checkpointing=False)  # fmt: skip
        phases = case_phase_seconds({"backward": [add]}, cal, case, world=world, cores=2)
        work = charged - add["count"] * (cal.op_call_us or 0.0) * 1e-6  # its dispatch stays at one thread's
        return work / (phases["backward"] - (charged - work))

    expected_fp32 = thread_speedup(cal, "fp32", charged)
    assert 1.75 < expected_fp32 <= 1.8
    assert share("fp32") == pytest.approx(expected_fp32)
    assert share("bf16") == pytest.approx(1.3)
    assert share("fp32", world=2) == pytest.approx(1.0)
    assert rank_share(cal, "fp32", 1, charged, cores=None) == 1.0  # plan --simulate: a calibrated thread per rank
    assert rank_share(cal.model_copy(update={"device": "cuda"}), "fp32", 1, charged, cores=2) == 1.0


def test_a_step_residual_is_the_probe_steps_unprofiled_time_over_its_charge():
    """Each probe with a wall time gives ``(charged s, wall / charged)`` under its dtype, sorted by charge; a probe
    recorded before the wall time was gives none; a wall time far off the charge (a burst of other work) is clamped.
    Planted bugs this catches: the factors left out of the charge (the residual reads 2x the planted 1.25), the
    residual inverted."""
    cal = calibration(operator_factors={"add": [(1.0, 2.0)]})
    adds = [entry("add", 2**20, count=100)]
    charged = 100 * (2.0 * work_seconds(adds[0], cal, on_gpu=False) + 5e-6)
    probes = [
        {"dtype": "float32", "entries": adds, "wall_s": 1.25 * charged},
        {"dtype": "float32", "entries": adds * 3, "wall_s": 3 * 1.10 * charged},
        {"dtype": "bfloat16", "entries": adds, "wall_s": 50 * charged},
        {"dtype": "float32", "entries": adds},  # an older probe: no wall time
    ]
    residuals = in_step.step_residuals(probes, cal)
    assert residuals["float32"] == [
        (pytest.approx(charged), pytest.approx(1.25)),
        (pytest.approx(3 * charged), pytest.approx(1.10)),
    ]
    assert residuals["bfloat16"] == [(pytest.approx(charged), in_step.RESIDUAL_RANGE[1])]


def test_the_step_model_multiplies_a_cases_operators_by_its_dtypes_residual_at_its_charge():
    """A case's operators (not its implementation's measured host work) times the residual of its precision, linear
    in log charge between the probes, the nearest beyond them, fp32's where its dtype was not probed, 1 without
    any. Planted bugs this catches: the residual not applied to the phases, applied to the host work too, looked up
    at the share-scaled charge (a world-1 case on two threads would read the larger probe's)."""
    from zbench.plan.simulate.calibration import ImplementationOverhead
    from zbench.plan.simulate.compute import case_phase_seconds, phase_seconds, step_residual
    from zbench.plan.trace.plan import make_case

    points = {"float32": [(0.1, 1.2), (1.0, 1.1)], "bfloat16": [(0.1, 1.5)]}
    cal = calibration(step_residuals=points)
    assert step_residual(cal, "fp32", 0.1) == pytest.approx(1.2) and step_residual(cal, "fp32", 10) == 1.1
    assert step_residual(cal, "fp32", 0.1**0.5) == pytest.approx(1.15)  # halfway in log charge
    assert step_residual(cal, "fp32", 0.001) == 1.2 and step_residual(cal, "bf16", 5.0) == 1.5
    assert step_residual(cal, "fp16", 1.0) == pytest.approx(1.1)  # not probed: fp32's
    assert step_residual(calibration(), "fp32", 1.0) == 1.0  # a profile from before the residuals
    host = ImplementationOverhead(per_step_us=1000, per_block_us=0, residuals_us={})
    with_host = cal.model_copy(update={"overheads": {"ddp-s0": host}})
    add = entry("add", 2**20, count=2000)  # 0.1 s of work and dispatch at one thread: above the first probe
    ops = {"backward": [add]}
    case = make_case("small", "ddp", 0, "none", gpus=1, precision="fp32", micro_batch=2, seq_len=64, device="cpu",
                     checkpointing=False)  # fmt: skip
    one_thread = phase_seconds(ops, with_host, traced_world=1, world=1, sharded_step=False)["backward"]
    expected = step_residual(cal, "fp32", one_thread)
    assert 1.1 < expected < 1.2
    for cores in (None, 2):  # one thread, or two threads with no speed-up measured: twice the work's speed
        share = 1.0 if cores is None else 2.0
        bare = phase_seconds(ops, with_host, traced_world=1, world=1, sharded_step=False, share=share)["backward"]
        phases = case_phase_seconds(ops, with_host, case, world=1, cores=cores)
        assert phases["backward"] == pytest.approx(bare * expected)
        assert phases["after_backward"] == pytest.approx(1e-3)  # measured host work: as measured
