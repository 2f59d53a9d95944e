"""``zbench tune``'s option search (``zbench.tune.options``): each implementation's declared options moved one at a
time on the setups that can win, traced from the real code, kept only where faster or leaner; and the verdict of
``--verify`` reading noise (setups the paired rounds cannot tell apart). Its own module, so that pytest-xdist runs
it beside tests/test_tune.py rather than after it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trace-cache")


# --- the option search: each implementation's declared options, one at a time from the default ------------------

OPTIONS_BASE = ("tune", "--model", "small", "--gpus", "2", "--cluster", "h100-sxm", "-i", "ddp", "-i", "zero2",
                "-i", "zero3", "--micro-batch", "1", "--checkpointing", "off", "--precision", "fp32", "-o", "none",
                "--top", "30", "--json")  # fmt: skip


@pytest.fixture(scope="module")
def with_options(cli, cache_dir):
    """ddp, zero2 and zero3 on two H100s at `small` (whose gradients fill several buckets), options searched."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
        r = cli(*OPTIONS_BASE)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_variants_move_one_declared_option_at_a_time_and_never_a_fixed_one():
    from zbench.plan.trace.plan import make_case
    from zbench.tune.options import variants

    def case(name: str, stage: int, **options: object):
        return make_case("tiny", name, stage, "none", gpus=2, precision="fp32", micro_batch=1, seq_len=32,
                         device="cpu", checkpointing=False, options=options)  # fmt: skip

    assert [v.options for v in variants(case("zero2", 2), {})] == [{"bucket_mb": x} for x in (1.0, 16.0, 64.0)]
    assert [v.options for v in variants(case("zero3", 3), {})] == [{"prefetch": 0}, {"prefetch": 2}]  # no buckets
    assert [v.options for v in variants(case("ddp", 0), {})] == [{"bucket_mb": 5.0}, {"bucket_mb": 100.0}]
    assert variants(case("zero3", 3, prefetch=1), {"prefetch": 1}) == []  # the user's --option stands
    assert variants(case("fsdp", 3), {}) == []  # declares none (its prefetch: see the FSDP2 test below)
    nvme = case("zero2", 2).model_copy(update={"offload": "nvme"})  # the sub-group size: with NVMe offload only
    assert [v.options for v in variants(nvme, {})][3:] == [{"nvme_chunk_mb": 16.0}, {"nvme_chunk_mb": 4.0}]
    # smaller sub-groups save host memory only: tried on a setup that missed it, not on one that fits or missed the GPU
    assert [v.options for v in variants(nvme, {}, "host per node")][3:] == [{"nvme_chunk_mb": x} for x in (16.0, 4.0)]
    assert [v.options for v in variants(nvme, {}, "fitting")] == [{"bucket_mb": x} for x in (1.0, 16.0, 64.0)]
    assert [v.options for v in variants(nvme, {}, "GPU")] == [{"bucket_mb": x} for x in (1.0, 16.0, 64.0)]


NVME_SUB_GROUPS = """
import json, torch
from zbench.cases.formulas import placement_for
from zbench.plan.trace.plan import TracedRow, make_case
from zbench.plan.trace.shims import fake_world
from zbench.plan.trace.tracer import trace_case
from zbench.tune.search import needs_of
out = {}
with fake_world(2):
    for chunk in (64.0, 0.0625):
        case = make_case("small", "zero2", 2, "nvme", gpus=2, precision="fp32", micro_batch=2, seq_len=64,
                         device="cpu", checkpointing=False, options={"nvme_chunk_mb": chunk})
        trace = trace_case(case, fake=True, device=torch.device("cpu"))
        assert trace.error is None, trace.error
        needs = needs_of(TracedRow(case, trace, placement_for(case)), gpus_per_node=2)
        calls = sum(e["count"] for e in trace.ops["after_backward"])
        out[chunk] = {"buffers": trace.buffers, "calls": calls, "gpu": needs.gpu, "host": needs.host_per_node,
                      "peak": trace.peak["device"]["bytes"]}
print(json.dumps(out))
"""


def test_smaller_nvme_sub_groups_buffer_less_on_the_host_and_cost_an_optimizer_call_each():
    """The NVMe sub-group size, traced from the real engine at `small` on two ranks: at 64 MiB each flat group is
    cut into eighths of at least 1 MiB, at 1/16 MiB into 64 KiB pieces. The three buffered sub-groups (fp32 master
    and AdamW's two moments each) are host memory, counted in the node's need and taken out of the CPU stand-in's
    device peak, which counts them: the GPU need is the same at both sizes. Each sub-group is one more optimizer
    call on the host, which the step model charges (``phase_seconds`` with offload: a call's cost each)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env

    result = subprocess.run([sys.executable, "-c", NVME_SUB_GROUPS], env=child_env(PYTHONWARNINGS="ignore"),
                            capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    big, small = json.loads(result.stdout).values()
    assert big["buffers"] == {"host": 3 * 3 * 2**18 * 4}  # 1 MiB (the floor): the model's groups are small
    assert small["buffers"] == {"host": 3 * 3 * 2**14 * 4}
    assert big["peak"] - small["peak"] == pytest.approx(big["buffers"]["host"] - small["buffers"]["host"], rel=0.01)
    assert small["gpu"] == pytest.approx(big["gpu"], rel=1e-3)
    assert big["host"] - small["host"] == 2 * (big["buffers"]["host"] - small["buffers"]["host"])  # two ranks a node
    assert small["calls"] > 4 * big["calls"]  # each charged one call's cost (test_trace_ops, by hand)


def test_the_option_search_keeps_what_is_faster_or_leaner_and_counts_the_rest(with_options):
    ranked = with_options["ranked"]
    defaults = {r["implementation"]: r for r in ranked if not r["options"]}
    assert set(defaults) == {"ddp", "zero2", "zero3"}
    lines = "\n".join(with_options["options_searched"])
    assert "ddp: option bucket_mb" in lines and "zero2: option bucket_mb" in lines and "zero3: option prefetch" in lines
    assert "zero3: option bucket_mb" not in lines  # declared for stages 1-2 only
    assert "variants of 3 setups traced" in lines
    for r in ranked:
        if r["options"]:  # every variant kept beats the setup it varies on speed or memory
            seed = defaults[r["implementation"]]
            faster = r["estimate"]["tokens_per_s_per_gpu"] > seed["estimate"]["tokens_per_s_per_gpu"]
            assert faster or r["needs"]["gpu"] < seed["needs"]["gpu"], r["name"]
            assert ", ".join(f"{k} " for k in r["options"]).strip(", ") in r["name"]


def test_a_prefetch_of_0_serializes_zero3s_gathers_and_holds_less(with_options):
    """Planted by the option: zero3 waits for each gather (nothing hidden: exposed equals all its communication,
    where the default hides all but one call per phase on an H100 profile), and holds fewer gathered blocks."""
    ranked = with_options["ranked"]
    default = next(r for r in ranked if r["implementation"] == "zero3" and not r["options"])
    serial = next(r for r in ranked if r["implementation"] == "zero3" and r["options"] == {"prefetch": 0})
    assert serial["estimate"]["exposed_comm_s"] == pytest.approx(serial["estimate"]["comm_s"])
    assert default["estimate"]["exposed_comm_s"] < default["estimate"]["comm_s"]
    assert serial["needs"]["gpu"] < default["needs"]["gpu"]


def test_a_smaller_bucket_means_more_collectives_in_the_trace():
    """The option reaches the real code: zero2 at `small` issues more reduce-scatters with 1 MiB buckets than with
    64, and DDP more all-reduces with 5 MiB than with 100 (the simulator charges each call its latency)."""
    from zbench.plan.trace.plan import make_case, trace_plan

    def calls(name: str, stage: int, op: str, bucket: float) -> int:
        case = make_case("small", name, stage, "none", gpus=2, precision="fp32", micro_batch=1, seq_len=32,
                         device="cpu", checkpointing=False, options={"bucket_mb": bucket})  # fmt: skip
        (row,) = trace_plan([case], device="cpu")
        return sum(e["count"] for ops in row.trace.phases.values() for o, e in ops.items() if o == op)

    assert calls("zero2", 2, "reduce_scatter", 1.0) > calls("zero2", 2, "reduce_scatter", 64.0) > 0
    assert calls("ddp", 0, "all_reduce", 5.0) > calls("ddp", 0, "all_reduce", 100.0) > 0


def test_a_fixed_option_is_not_searched_and_no_search_turns_it_off(cli, cache_dir, monkeypatch):
    monkeypatch.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
    base = ("tune", "--model", "small", "--gpus", "2", "--cluster", "h100-sxm", "-i", "zero3", "--micro-batch", "1",
            "--checkpointing", "off", "--precision", "fp32", "-o", "none", "--json")  # fmt: skip
    r = cli(*base, "--option", "prefetch=1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert all(s["options"] == {"prefetch": 1} for s in doc["ranked"] + doc["pruned"])
    assert "tracing zero3 stage 3 offload none, prefetch 1" in r.stderr  # progress names a setup's options
    r = cli(*base, "--no-search-options")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["options_searched"] == [] and all(not s["options"] for s in doc["ranked"])


def test_the_option_search_varies_every_seed_and_keeps_only_a_faster_or_leaner_variant():
    """Planted on candidates, no tracing: two zero3 seeds that differ only in micro-batch each get both prefetch
    variants; a variant predicted faster is kept, one leaner is kept, a tie and one that does not fit are dropped."""
    from zbench.plan.simulate.step import StepEstimate
    from zbench.plan.trace.plan import make_case
    from zbench.tune.options import search_options
    from zbench.tune.search import Candidate, Needs

    def candidate(case, rate: float, gpu: float, pruned: str | None = None) -> Candidate:
        est = StepEstimate(world=2, compute_s=1.0, comm_s=0.0, exposed_comm_s=0.0, offload_s=0.0, step_s=1.0,
                           tokens_per_s_per_gpu=rate, mfu=0.5, comm_to_compute=0.0, compute_model="operators",
                           hides_gathers=True, phase_comm_s={})  # fmt: skip
        return Candidate(case, needs=Needs(gpu=gpu, host_per_node=0.0, disk_per_node=0.0), pruned=pruned,
                         estimate=None if pruned else est)  # fmt: skip

    seeds = [
        candidate(make_case("tiny", "zero3", 3, "none", gpus=2, precision="fp32", micro_batch=mb, seq_len=32,
                            device="cpu", checkpointing=False), rate=100.0 * mb, gpu=10.0 * mb)
        for mb in (2, 1)
    ]  # fmt: skip
    planted = {  # (micro-batch, prefetch) -> (rate, gpu, pruned)
        (2, 0): (200.0, 15.0, None),  # leaner: kept
        (2, 2): (200.0, 20.0, None),  # a tie: dropped
        (1, 0): (100.0, 10.0, "GPU: over"),  # does not fit: dropped
        (1, 2): (150.0, 12.0, None),  # faster: kept
    }
    asked = []

    def run(cases):
        asked.extend((c.micro_batch, c.options["prefetch"]) for c in cases)
        return [candidate(c, *planted[(c.micro_batch, c.options["prefetch"])]) for c in cases]

    found = search_options(seeds, {}, run)
    assert sorted(asked) == sorted(planted)
    assert sorted((c.case.micro_batch, c.case.options["prefetch"]) for c in found.kept) == [(1, 2), (2, 0)]
    assert "4 variants of 2 setups traced; 2 kept" in found.summary and "2 dropped" in found.summary


def test_of_two_variants_the_model_cannot_tell_apart_the_one_nearer_the_default_is_kept():
    """Planted: zero1's 16 and 64 MiB buckets both beat the default 4 MiB and predict alike (both larger than every
    gradient of a small model), so only 16 MiB, first in the declared order, reaches the ranking; a 64 MiB bucket
    that is faster by more than the margin is kept beside it."""
    from zbench.plan.simulate.step import StepEstimate
    from zbench.plan.trace.plan import make_case
    from zbench.tune.options import MARGIN, search_options
    from zbench.tune.search import Candidate, Needs

    def candidate(case, rate: float) -> Candidate:
        est = StepEstimate(world=2, compute_s=1.0, comm_s=0.0, exposed_comm_s=0.0, offload_s=0.0, step_s=1.0,
                           tokens_per_s_per_gpu=rate, mfu=0.5, comm_to_compute=0.0, compute_model="operators",
                           hides_gathers=True, phase_comm_s={})  # fmt: skip
        return Candidate(case, needs=Needs(gpu=10.0, host_per_node=0.0, disk_per_node=0.0), estimate=est)

    seed = candidate(make_case("tiny", "zero1", 1, "none", gpus=2, precision="fp32", micro_batch=2, seq_len=32,
                               device="cpu", checkpointing=False), rate=100.0)  # fmt: skip
    for rate_64, kept in ((110.0 * (1 + MARGIN / 2), [16]), (110.0 * (1 + 3 * MARGIN), [16, 64])):
        planted = {1: 90.0, 16: 110.0, 64: rate_64}
        run = lambda cases, p=planted: [candidate(c, p[c.options["bucket_mb"]]) for c in cases]
        found = search_options([seed], {}, run)
        assert [c.case.options["bucket_mb"] for c in found.kept] == kept
        assert f"3 variants of 1 setups traced; {len(kept)} kept" in found.summary
        assert ("level with a value kept before it: 1" in found.summary) == (kept == [16])


def test_smaller_nvme_sub_groups_are_tried_only_where_host_memory_was_missed_and_kept_where_one_fits():
    """Planted: three zero3 NVMe setups, one fitting, one over the GPU, one over a node's host memory by 1%. Only
    the last gets the sub-group sizes tried (on the others they could save nothing that matters: never time, never
    GPU memory); its 16 MiB variant fits and is kept, the 4 MiB one, level with it, is not listed twice."""
    from zbench.plan.simulate.step import StepEstimate
    from zbench.plan.trace.plan import make_case
    from zbench.tune.options import search_options
    from zbench.tune.search import Candidate, Needs

    est = StepEstimate(world=2, compute_s=1.0, comm_s=0.0, exposed_comm_s=0.0, offload_s=0.0, step_s=1.0,
                       tokens_per_s_per_gpu=100.0, mfu=0.5, comm_to_compute=0.0, compute_model="operators",
                       hides_gathers=True, phase_comm_s={})  # fmt: skip

    def case(mb: int):
        return make_case("tiny", "zero3", 3, "nvme", gpus=2, precision="fp32", micro_batch=mb, seq_len=32,
                         device="cpu", checkpointing=False)  # fmt: skip

    needs = Needs(gpu=5.0, host_per_node=100.0, disk_per_node=0.0)
    ranked = [
        Candidate(case(1), needs=needs, estimate=est),
        Candidate(case(4), needs=needs, pruned="GPU: over by 5%", overshoot=0.05),
        Candidate(case(2), needs=needs, pruned="host per node: over by 1%", overshoot=0.01),
    ]
    tried = []

    def run(cases):
        tried.extend((c.micro_batch, c.options) for c in cases)
        return [Candidate(c, needs=needs, estimate=est) if c.micro_batch == 2 and "nvme_chunk_mb" in c.options
                else Candidate(c, needs=needs, pruned="GPU: over by 9%", overshoot=0.09) for c in cases]  # fmt: skip

    found = search_options(ranked, {}, run)
    chunks = [(mb, o["nvme_chunk_mb"]) for mb, o in tried if "nvme_chunk_mb" in o]
    assert chunks == [(2, 16.0), (2, 4.0)]
    assert {mb for mb, o in tried if "prefetch" in o} == {1, 2, 4}  # the other option: on every seed
    assert [(c.case.micro_batch, c.case.options) for c in found.kept] == [(2, {"nvme_chunk_mb": 16.0})]


def test_the_nearest_gpu_misses_are_searched_too_and_a_variant_that_fits_is_kept():
    """Planted: of six zero3 setups that do not fit, the three traced ones nearest the GPU's limit get their
    options searched, and the traced one that missed host memory (not one pruned untraced by the formulas); a
    prefetch-0 variant that fits is kept (rescued), one that still does not is dropped."""
    from zbench.plan.simulate.step import StepEstimate
    from zbench.plan.trace.plan import make_case
    from zbench.tune.options import NEAR_MISSES, search_options, seeds
    from zbench.tune.search import Candidate, Needs

    est = StepEstimate(world=2, compute_s=1.0, comm_s=0.0, exposed_comm_s=0.0, offload_s=0.0, step_s=1.0,
                       tokens_per_s_per_gpu=100.0, mfu=0.5, comm_to_compute=0.0, compute_model="operators",
                       hides_gathers=True, phase_comm_s={})  # fmt: skip

    def case(mb: int, ckpt: bool = False):
        return make_case("tiny", "zero3", 3, "none", gpus=2, precision="fp32", micro_batch=mb, seq_len=32,
                         device="cpu", checkpointing=ckpt)  # fmt: skip

    def missed(c, over: float, what: str = "GPU", traced: bool = True) -> Candidate:
        needs = Needs(gpu=10.0 * (1 + over), host_per_node=0.0, disk_per_node=0.0) if traced else None
        return Candidate(c, needs=needs, pruned=f"{what}: over by {over:.0%}", overshoot=over)

    fits = Candidate(case(1), needs=Needs(gpu=5.0, host_per_node=0.0, disk_per_node=0.0), estimate=est)
    ranked = [
        fits,
        missed(case(1, True), 0.01, "host per node"),
        missed(case(2), 0.02, traced=False),
        missed(case(2, True), 0.05),
        missed(case(4), 0.1),
        missed(case(4, True), 0.3),
        missed(case(8), 0.9),
    ]
    near = [c for c in seeds(ranked) if c.pruned is not None]
    assert NEAR_MISSES == 3 and [c.overshoot for c in near] == [0.05, 0.1, 0.3, 0.01]

    def run(cases):
        out = []
        for c in cases:
            fit = c.micro_batch == 2 and c.options == {"prefetch": 0}  # planted: only this variant fits
            out.append(Candidate(c, needs=Needs(gpu=9.0, host_per_node=0.0, disk_per_node=0.0), estimate=est)
                       if fit else missed(c, 0.04))  # fmt: skip
        return out

    found = search_options(ranked, {}, run)
    assert [(c.case.micro_batch, c.case.activation_checkpointing, c.case.options) for c in found.kept] == [
        (2, True, {"prefetch": 0})
    ]
    assert "1 kept (faster or leaner than the setup they vary, 1 fitting where it did not)" in found.summary
    # and no variant is pruned untraced for a smaller micro-batch of *other* options not fitting (a prefetch of 2
    # at micro-batch 1 says nothing of a prefetch of 0 at micro-batch 2: gpt-70b on 8 RTX 4090s is that case)
    from zbench.tune.search import _siblings

    deeper = case(1, True).model_copy(update={"options": {"prefetch": 2}})
    assert _siblings(deeper) != _siblings(case(2, True).model_copy(update={"options": {"prefetch": 0}}))
    assert _siblings(deeper) == _siblings(case(2, True).model_copy(update={"options": {"prefetch": 2}}))


def test_setups_the_paired_rounds_cannot_tell_apart_are_level_and_a_clear_gap_is_not():
    """Planted paired ratios (a setup's step over DDP's, round by round): noise around the best's is level with
    it, a setup 30% slower in every round is told apart, one with a single round is not compared; the verdict
    counts a level setup in the predicted top two."""
    import random

    from zbench.tune.verify import Verification, level_with

    rng = random.Random(0)
    best = [1.0] * 10  # the DDP reference: the yardstick, 1 in each round
    samples = {
        2: best,
        1: [1.0 + rng.gauss(0, 0.04) for _ in range(10)],  # noise around the best: level
        3: [1.3 + rng.gauss(0, 0.04) for _ in range(10)],  # 30% slower: told apart
        4: [1.0],  # one round: not compared
    }
    assert level_with(2, [1, 3, 4], samples) == [1]
    v = Verification(run_id="r", run_path="p", rows=[], kendall_tau=0.0, measured_best_rank=4, level_with_best=[2])
    assert v.best_in_top_two is False and v.a_best_in_top_two is True
    assert (
        Verification(run_id="r", run_path="p", rows=[], kendall_tau=0.0, measured_best_rank=4).a_best_in_top_two
        is False
    )


def verified_rows(predicted: list[float], measured: list[float]) -> list:
    """Verified setups ranked 1, 2, ... in the order given, each measured at one rate (paired and own steps alike)."""
    from zbench.tune.verify import Verified

    return [Verified(rank=rank, name=str(rank), case_id=str(rank), predicted_tokens_per_s_per_gpu=p,
                     predicted_gpu_bytes=1.0, measured_tokens_per_s_per_gpu=m, steady_tokens_per_s_per_gpu=m)
            for rank, (p, m) in enumerate(zip(predicted, measured, strict=True), start=1)]  # fmt: skip


def test_only_the_pairs_the_measurement_tells_apart_judge_the_predicted_order():
    """Planted rounds for four setups: #1 and #2 differ by 1% (inside the rounds' 4% noise: unresolved), #3 is 30%
    slower than both in every round, #4 has one round (not compared). Predicted in the measured order, gamma is 1
    over the 2 resolved pairs; predicted with #3 first, -1: the noise pair cannot rescue or sink the verdict. A
    setup whose paired rate and own steps' rate differ by more than ``DISAGREEMENT`` is named in a note."""
    import random
    import statistics

    from zbench.tune.verify import DISAGREEMENT, Verification, _notes, resolved_order

    rng = random.Random(1)
    samples = {
        1: [100.0 * (1 + rng.gauss(0, 0.04)) for _ in range(12)],
        2: [99.0 * (1 + rng.gauss(0, 0.04)) for _ in range(12)],
        3: [70.0 * (1 + rng.gauss(0, 0.04)) for _ in range(12)],
        4: [50.0],
    }

    def rows(predicted):
        return verified_rows(predicted, [statistics.median(samples[rank]) for rank in samples])

    assert resolved_order(rows([100, 99, 70, 50]), samples) == (2, 2)
    assert resolved_order(rows([100, 101, 70, 50]), samples) == (2, 2)  # the unresolved pair swapped: no matter
    assert resolved_order(rows([80, 79, 120, 50]), samples) == (2, 0)  # the 30% gap reversed: caught
    judged = Verification(run_id="r", run_path="p", rows=[], kendall_tau=None, measured_best_rank=1,
                          resolved_pairs=2, resolved_agreeing=0)  # fmt: skip
    assert judged.resolved_gamma == -1.0 and judged.to_json()["resolved_gamma"] == -1.0
    unresolved = Verification(run_id="r", run_path="p", rows=[], kendall_tau=None, measured_best_rank=1)
    assert unresolved.resolved_gamma is None
    steady = rows([100, 99, 70, 50])
    notes = _notes(steady, steady, 1.0, 2, 2)
    assert "tells 2 of 6 pairs of setups apart" in notes[-1] and "gamma 1.00" in notes[-1]
    assert not any("speed changed" in n for n in notes)
    steady[1].steady_tokens_per_s_per_gpu = steady[1].measured_tokens_per_s_per_gpu * (1 + 2 * DISAGREEMENT)
    (moved,) = [n for n in _notes(steady, steady, 1.0, 2, 2) if "speed changed" in n]
    assert moved.startswith("#2's rate") and "differ by 17%" in moved
    steady[1].steady_tokens_per_s_per_gpu = steady[1].measured_tokens_per_s_per_gpu * (1 + DISAGREEMENT / 2)
    assert not any("speed changed" in n for n in _notes(steady, steady, 1.0, 2, 2))  # usual disagreement: quiet


def test_predictions_closer_than_the_models_ratio_error_are_called_a_guess():
    """Verified setups whose predictions lie within the step model's measured median error on a ratio to DDP
    (``CALIBRATED_RATIO_ERROR``) of each other get a note that their order is a guess; a spread wider than that
    error gets none."""
    from zbench.plan.simulate.sweep import CALIBRATED_RATIO_ERROR
    from zbench.tune.verify import _notes

    measured = [100.0, 99.0, 98.0]
    close = verified_rows([100 * (1 + CALIBRATED_RATIO_ERROR * 0.9), 100.0, 100.0], measured)
    (guess,) = [n for n in _notes(close, close, 1.0, 0, 0) if "is a guess" in n]
    assert f"within {CALIBRATED_RATIO_ERROR * 0.9:.1%}" in guess and f"({CALIBRATED_RATIO_ERROR:.1%} on" in guess
    apart = verified_rows([100 * (1 + CALIBRATED_RATIO_ERROR * 1.1), 100.0, 100.0], measured)
    assert not any("is a guess" in n for n in _notes(apart, apart, 1.0, 0, 0))


# --- FSDP1's backward prefetch: a real option of the real code, serializing backward alone ------------------------


def test_fsdp1_backward_prefetch_post_holds_a_unit_less_and_waits_for_backwards_gathers_only():
    """The option reaches FSDP1 (traced at `small` on 8 ranks): ``post`` gathers the next unit only after the current
    one's gradients, so backward's peak holds one unit's parameters fewer than ``pre``; the step model then charges
    backward's collectives as exposed and hides forward's as before (``Tunable.serialized_phases``)."""
    from zbench.plan.simulate import cluster as clusters
    from zbench.plan.simulate.sweep import estimate_row, serialized

    pre, post = _small_at_stage_3("fsdp1", 512, [{"backward_prefetch": "pre"}, {"backward_prefetch": "post"}])
    gathered = [r.trace.peak["device"]["roles"]["gathered parameters"] for r in (pre, post)]
    assert gathered[1] < gathered[0]
    assert post.trace.peak["device"]["bytes"] < pre.trace.peak["device"]["bytes"]
    assert serialized(pre.case) == frozenset() and serialized(post.case) == {"backward"}
    h100 = clusters.load("h100-sxm")
    before, after = estimate_row(pre, h100, 64), estimate_row(post, h100, 64)
    assert before.phase_comm_s == after.phase_comm_s  # the same collectives, waited for differently
    everything = estimate_row(replace(post, case=_serialize_both(post.case)), h100, 64)
    assert everything.exposed_comm_s == pytest.approx(after.comm_s)  # both phases waited for: nothing hidden
    assert before.exposed_comm_s < after.exposed_comm_s < everything.exposed_comm_s  # forward still hides
    assert after.exposed_comm_s - before.exposed_comm_s <= after.phase_comm_s["backward"]


def test_fsdp2_prefetch_holds_more_units_gathered_and_sends_the_same():
    """The option reaches FSDP2 (traced at `small` on 8 ranks, short rows so that parameters, not activations, make
    the peak): one unit ahead holds what torch's own scheduling holds (its implicit backward prefetch is one unit),
    two units ahead one more unit's gathered parameters, with the same collectives, which the step model hides alike:
    no faster and no leaner whatever the depth, which is why ``zbench tune`` does not search it."""
    from zbench.plan.simulate import cluster as clusters
    from zbench.plan.simulate.sweep import estimate_row, serialized

    rows = _small_at_stage_3("fsdp", 64, [{"prefetch": depth} for depth in (0, 1, 2)])
    gathered = [r.trace.peak["device"]["roles"]["gathered parameters"] for r in rows]
    assert gathered[0] == gathered[1] and gathered[2] == 2 * gathered[0]  # small's units are alike: one more
    assert rows[2].trace.peak["device"]["bytes"] > rows[0].trace.peak["device"]["bytes"]
    assert all(serialized(r.case) == frozenset() for r in rows)
    h100 = clusters.load("h100-sxm")
    assert len({repr(estimate_row(r, h100, 64).phase_comm_s) for r in rows}) == 1


def test_fsdp2_rejects_a_prefetch_that_is_not_a_count_of_units_in_one_line():
    import torch

    from zbench.implementations.fsdp import prefetch_depth
    from zbench.protocol import TrainSpec

    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"fsdp option prefetch must be a whole number of units >= 0, got {bad!r}"):
            prefetch_depth(TrainSpec(device=torch.device("cpu"), stage=3, options={"prefetch": bad}))
    assert prefetch_depth(TrainSpec(device=torch.device("cpu"))) == 0  # torch's own scheduling


def _small_at_stage_3(implementation: str, seq_len: int, options: list[dict]) -> list:
    """`small` at stage 3 on 8 ranks in bf16, one micro-batch of ``seq_len`` tokens, traced with each of ``options``."""
    from zbench.plan.trace.plan import make_case, trace_plan

    cases = [make_case("small", implementation, 3, "none", gpus=8, precision="bf16", micro_batch=1, seq_len=seq_len,
                       device="cpu", checkpointing=False, options=o) for o in options]  # fmt: skip
    rows = trace_plan(cases, device="cpu")
    assert all(row.trace.error is None for row in rows), [row.trace.error for row in rows]
    return rows


def _serialize_both(case):
    """``case`` as a ZeRO-3 prefetch of 0 would wait: its implementation's tunable declared for both phases."""
    caps = case.capabilities
    tunables = tuple(replace(t, serialized_phases=frozenset({"forward", "backward"})) for t in caps.tunables)
    return case.model_copy(update={"capabilities": replace(caps, tunables=tunables)})


def test_fsdp1_rejects_an_unknown_backward_prefetch_in_one_line():
    import torch

    from zbench.implementations.fsdp1 import backward_prefetch
    from zbench.protocol import TrainSpec

    with pytest.raises(ValueError, match="backward_prefetch must be one of pre, post, none, got 'early'"):
        backward_prefetch(TrainSpec(device=torch.device("cpu"), stage=3, options={"backward_prefetch": "early"}))
    assert backward_prefetch(TrainSpec(device=torch.device("cpu"))) is not None  # torch's default: BACKWARD_PRE


def test_deepspeeds_best_has_its_bucket_searched_but_its_estimates_take_no_traced_setups_place():
    """Planted, no tracing: a DeepSpeed estimate ties its stand-in. DeepSpeed's best is a seed, its bucket varied
    (50M elements by default, then 5M and DeepSpeed's own 500M) and its overlap turned on; among the three fastest
    and the three nearest misses only traced setups count, so an estimate beside each takes none of their places."""
    from zbench.plan.simulate.step import StepEstimate
    from zbench.plan.trace.plan import make_case
    from zbench.tune.options import seeds, variants
    from zbench.tune.search import Candidate, Needs

    def setup(name: str, mb: int, rate: float | None, over: float = 0.0) -> Candidate:
        case = make_case("tiny", name, 1, "none", gpus=2, precision="fp32", micro_batch=mb, seq_len=32,
                         device="cpu", checkpointing=False)  # fmt: skip
        est = StepEstimate(world=2, compute_s=1.0, comm_s=0.0, exposed_comm_s=0.0, offload_s=0.0, step_s=1.0,
                           tokens_per_s_per_gpu=rate or 0.0, mfu=0.5, comm_to_compute=0.0,
                           compute_model="operators", hides_gathers=True, phase_comm_s={})  # fmt: skip
        c = Candidate(case, needs=Needs(gpu=10.0 * (1 + over), host_per_node=0.0, disk_per_node=0.0),
                      estimate=est if rate else None, pruned=None if rate else f"GPU: over by {over:.0%}",
                      overshoot=over)  # fmt: skip
        c.estimated_from = "zero1, bucket_mb 190.735" if name == "deepspeed" else None
        return c

    ranked = [setup(name, mb, rate) for mb, rate in ((1, 100.0), (2, 90.0), (4, 80.0)) for name in ("zero1",
              "deepspeed")]  # fmt: skip
    ranked += [setup(name, 8, None, over) for name, over in (("deepspeed", 0.01), ("zero1", 0.1))]
    ranked += [setup("zero1", mb, None, over) for mb, over in ((16, 0.2), (32, 0.3))]
    chosen = [(c.case.implementation, c.case.micro_batch) for c in seeds(ranked)]
    assert chosen == [("zero1", 1), ("zero1", 2), ("zero1", 4), ("deepspeed", 1), ("zero1", 8), ("zero1", 16),
                      ("zero1", 32)]  # fmt: skip
    ds_best = ranked[1]
    assert [v.options for v in variants(ds_best.case, {})] == [{"bucket_size": 5_000_000},
                                                               {"bucket_size": 500_000_000},
                                                               {"overlap_comm": True}]  # fmt: skip
    fixed = {"bucket_size": 5_000_000, "overlap_comm": False}
    assert variants(ds_best.case, fixed) == []  # fixed by --option: not searched
