"""The trace's operator ledger and the step model's operator-level compute: traced FLOPs against the model's
own count (forward, backward twice forward, checkpointing's recompute), and each operator charged from a
planted calibration by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env
from zbench.plan.simulate.calibration import BandwidthPoint, Calibration, MatmulPoint
from zbench.plan.simulate.compute import flop_rate, op_seconds, phase_seconds

TRACE = """
import json, sys, torch
from zbench.cases.model_source import model_info
from zbench.plan.trace.plan import make_case
from zbench.plan.trace.shims import fake_world
from zbench.plan.trace.tracer import trace_case
out = {}
with fake_world(2):
    for impl, stage, ckpt in (("ddp", 0, False), ("zero3", 3, False), ("zero3", 3, True), ("fsdp", 3, False)):
        case = make_case("small", impl, stage, "none", gpus=2, precision="fp32", micro_batch=2, seq_len=64,
                         device="cpu", checkpointing=ckpt)
        trace = trace_case(case, fake=True, device=torch.device("cpu"))
        assert trace.error is None, trace.error
        flops = {p: sum(e["flops"] * e["count"] for e in es) for p, es in trace.ops.items()}
        calls = {p: sum(e["count"] for e in es) for p, es in trace.ops.items()}
        out[f"{impl}-{ckpt}"] = {"flops": flops, "calls": calls, "ops": trace.ops}
out["model"] = model_info("small").flops_per_token(64) * 2 * 64
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def traced():
    result = subprocess.run(
        [sys.executable, "-c", TRACE], env=child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("run", ["ddp-False", "zero3-False", "fsdp-False"])
def test_traced_flops_are_the_models_count_split_a_third_forward(traced, run):
    """The model's training FLOPs (6N per token plus attention, the simulator's count) against what torch's
    formulas say the traced operators did, for three layouts of the same model: the same compute."""
    flops = traced[run]["flops"]
    assert flops["forward"] == pytest.approx(traced["model"] / 3, rel=0.05)
    assert flops["backward"] == pytest.approx(2 * flops["forward"], rel=0.05)
    assert flops.get("after_backward", 0) == 0  # the optimizer step computes nothing torch counts as FLOPs
    assert traced[run]["calls"]["after_backward"] > 0  # but it runs operators: they cost memory time


def test_checkpointing_recomputes_the_blocks_forward_inside_backward_up_to_what_backward_needs(traced):
    """Checkpointing wraps the blocks, not the LM head, and torch's non-reentrant checkpoint stops recomputing
    once every tensor backward needs is back: the MLP's down projection (its output is needed by nothing) is
    not run again. So backward gains the blocks' forward less each block's down projection, not a whole
    forward (the peak x efficiency model's assumption, a third of the MLP too much)."""
    from zbench.presets import PRESETS

    plain, ckpt = traced["zero3-False"]["flops"], traced["zero3-True"]["flops"]
    gpt, tokens = PRESETS["small"], 2 * 64
    head = 2 * tokens * gpt.d_model * gpt.vocab
    down = gpt.layers * 2 * tokens * gpt.ffn_hidden * gpt.d_model
    assert ckpt["forward"] == pytest.approx(plain["forward"], rel=0.01)
    assert ckpt["backward"] - plain["backward"] == pytest.approx(plain["forward"] - head - down, rel=0.03)


def _calibration(device: str = "cpu", op_call_us: float = 2.0) -> Calibration:
    """Planted: fp32 products at 1 TFLOP/s for 2e6 FLOPs and 3 TFLOP/s for 2e9; memory 10 GB/s."""
    return Calibration(
        measured_at="2026-11-27T00:00:00+00:00", host="planted", torch="x", zbench="x", device=device,
        backend="gloo", ranks=2, threads_per_rank=1, seconds=0.0,
        matmul=[MatmulPoint(m=100, k=100, n=100, dtype="float32", tflops=1.0),
                MatmulPoint(m=1000, k=1000, n=1000, dtype="float32", tflops=3.0)],
        memory_bound=[BandwidthPoint(op="copy", bytes=1, gb_s=10.0), BandwidthPoint(op="add", bytes=1, gb_s=10.0)],
        collectives=[], hook_call_us=0.0, op_call_us=op_call_us, copies_gb_s={"host_copy": 1.0},
        host_adam_params_per_s=1.0,
    )  # fmt: skip


def test_flop_rate_interpolates_in_log_flops_and_holds_beyond_the_table():
    cal = _calibration()
    assert flop_rate(cal, "float32", 2e6) == pytest.approx(1e12)
    assert flop_rate(cal, "float32", 2e9) == pytest.approx(3e12)
    assert flop_rate(cal, "float32", 2e6 * 10**1.5) == pytest.approx(2e12)  # halfway in log
    assert flop_rate(cal, "float32", 1.0) == pytest.approx(1e12) and flop_rate(cal, "float32", 1e15) == 3e12
    assert flop_rate(cal, "bfloat16", 2e9) == pytest.approx(3e12)  # not measured: the first dtype's table


def test_each_operator_is_charged_by_hand():
    cal = _calibration()
    matmul = {"op": "mm", "dtype": "float32", "flops": 2e9, "bytes": 12e6, "count": 3}
    add = {"op": "add", "dtype": "float32", "flops": 0, "bytes": 3e6, "count": 5}
    assert op_seconds(matmul, cal, on_gpu=False) == pytest.approx(3 * (2e9 / 3e12 + 2e-6))
    assert op_seconds(add, cal, on_gpu=False) == pytest.approx(5 * (3e6 / 10e9 + 2e-6))
    tiny = {"op": "add", "dtype": "float32", "flops": 0, "bytes": 8, "count": 10}
    assert op_seconds(tiny, cal, on_gpu=True) == pytest.approx(10 * 2e-6)  # launch-bound on a GPU
    # a CPU rank maps each large tensor an operator creates (glibc's threshold pinned), a GPU's allocator reuses
    fresh = {"op": "gelu", "dtype": "float32", "flops": 0, "bytes": 3e6, "mapped_bytes": 1e6, "count": 2}
    mapping = cal.model_copy(update={"mapped_gb_s": 5.0})
    assert op_seconds(fresh, mapping, on_gpu=False) == pytest.approx(2 * (3e6 / 10e9 + 1e6 / 5e9 + 2e-6))
    assert op_seconds(fresh, cal, on_gpu=False) == op_seconds(add | {"count": 2}, cal, on_gpu=False)  # not measured
    assert op_seconds(fresh, mapping, on_gpu=True) == pytest.approx(2 * max(3e6 / 10e9, 2e-6))
    ops = {"forward": [matmul], "after_backward": [add]}
    at_8 = phase_seconds(ops, cal, traced_world=2, world=8, sharded_step=True)
    assert at_8["after_backward"] == pytest.approx(5 * (3e6 / 10e9 / 4 + 2e-6))  # a quarter of the work, every call
    # offloaded on a GPU, the host step's work is the offload model's; each of its calls is still one thread's
    # dispatch. On a CPU the host is the device: the traced operators are the host's work, charged as without offload
    on_gpu = _calibration(device="H100")
    offloaded = phase_seconds(ops, on_gpu, traced_world=2, world=2, sharded_step=True, offload="optimizer")
    assert offloaded["after_backward"] == pytest.approx(5 * 2e-6)
    on_host = phase_seconds(ops, cal, traced_world=2, world=2, sharded_step=True, offload="optimizer")
    assert on_host == phase_seconds(ops, cal, traced_world=2, world=2, sharded_step=True)
    assert phase_seconds(ops, cal, traced_world=2, world=8, sharded_step=False)["after_backward"] == pytest.approx(
        op_seconds(add, cal, on_gpu=False)
    )


def test_a_memory_bound_operator_is_charged_the_bandwidth_of_its_own_working_set():
    """Planted probes: 100 GB/s where a working set stays in cache (256 KiB tensors), 10 GB/s streaming (64 MiB);
    an operator moving as much as a probe gets that probe's rate (``copy`` moves 2x its input, ``add`` 3x), one
    between gets a rate between (linear in log bytes), one beyond either end that end's; a calibration of one size
    (older profiles, datasheets) charges every operator the same."""
    from zbench.plan.simulate.compute import memory_bandwidth

    small, large = 256 * 2**10, 64 * 2**20
    cal = _calibration().model_copy(
        update={
            "memory_bound": [
                BandwidthPoint(op="copy", bytes=small, gb_s=100.0),
                BandwidthPoint(op="add", bytes=small, gb_s=100.0),
                BandwidthPoint(op="copy", bytes=large, gb_s=10.0),
                BandwidthPoint(op="add", bytes=large, gb_s=10.0),
            ]
        }
    )
    at_small, at_large = 2.5 * small, 2.5 * large  # between copy's working set (2x) and add's (3x) of one size
    assert memory_bandwidth(cal, at_small) == pytest.approx(100e9)
    assert memory_bandwidth(cal, at_large) == pytest.approx(10e9)
    assert 10e9 < memory_bandwidth(cal, 2 * 2**20 * 2.5) < 100e9
    assert memory_bandwidth(cal, 8) == pytest.approx(100e9) and memory_bandwidth(cal, 1e12) == pytest.approx(10e9)
    add = {"op": "add", "dtype": "float32", "flops": 0, "bytes": 3 * small, "count": 1}
    assert op_seconds(add, cal, on_gpu=False) == pytest.approx(3 * small / 100e9 + 2e-6)
    one_size = _calibration()
    assert memory_bandwidth(one_size, 8) == memory_bandwidth(one_size, 1e12) == memory_bandwidth(one_size) == 10e9


def test_simulate_with_a_calibrated_profile_charges_operators(cli, tmp_path, traced):
    from zbench.plan.calibrate.profile import derive, to_yaml
    from zbench.plan.simulate.cluster import load

    profile = tmp_path / "planted.yaml"
    cal = _calibration()  # no collectives or disk measured: those figures come from the base profile
    planted = derive(cal, name="planted", gpu="CPU", memory_gib=8, ranks_per_node=2, base=load("cpu-2core"))
    profile.write_text(to_yaml(planted))
    r = cli("plan", "--simulate", str(profile), "--model", "small", "-i", "ddp", "-o", "none", "--gpus", "2",
            "--precision", "fp32", "--micro-batch", "2", "--seq-len", "64", "--scale", "2", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["rows"]
    (est,) = row["estimates"]
    assert est["compute_model"] == "operators"
    by_hand = phase_seconds(traced["ddp-False"]["ops"], cal, traced_world=2, world=2, sharded_step=False)
    assert est["compute_s"] == pytest.approx(sum(by_hand.values()), rel=0.02)


def test_a_cpu_ranks_share_of_the_cores_against_one_calibrated_thread():
    from zbench.plan.simulate.compute import cpu_share

    assert cpu_share(1, 2, 1) == 2  # one rank runs both cores' threads
    assert cpu_share(2, 2, 1) == 1
    assert cpu_share(4, 2, 1) == 0.5  # four ranks on two cores: half a core each
    assert cpu_share(3, 16, 2) == 2.5  # 5 threads each, calibrated on 2
    # with the speed-up the calibration measured on every core (two threads 1.34x one, not 2x)
    assert cpu_share(1, 2, 1, 1.34) == pytest.approx(1.34)
    assert cpu_share(2, 2, 1, 1.34) == 1 and cpu_share(4, 2, 1, 1.34) == 0.5  # one thread each, or less
    assert cpu_share(2, 16, 1, 9.0) == pytest.approx(1 + 8 * 7 / 15)  # 8 of 16 threads: linear between


def test_ranks_that_fill_the_cores_run_the_measured_co_run_slow_down_slower(monkeypatch):
    """What the calibration's lone step lost with every other core running it too slows ranks whose threads fill the
    cores, and only them. Planted bugs this catches: the slow-down taken at world 1 (whose two-thread speed-up was
    measured on both cores, its loss already in), a speed-up instead of a slow-down, ranks that leave cores idle
    slowed."""
    from zbench.plan.simulate.compute import cpu_share

    assert cpu_share(1, 2, 1, 1.6, corun_slowdown=1.25) == pytest.approx(1.6)
    assert cpu_share(2, 2, 1, 1.6, corun_slowdown=1.25) == pytest.approx(0.8)
    assert cpu_share(4, 2, 1, 1.6, corun_slowdown=1.25) == pytest.approx(0.4)  # half a core each, and shared
    assert cpu_share(2, 16, 1, 9.0, corun_slowdown=1.25) == pytest.approx(1 + 8 * (8 / 1.25 - 1) / 15)
    monkeypatch.setenv("ZBENCH_THREADS_PER_RANK", "1")
    assert cpu_share(2, 16, 1, 9.0, corun_slowdown=1.25) == 1  # two ranks on one core each of 16: 14 idle


def test_bytes_moved_follow_the_schema_in_place_out_and_lists():
    """In place reads and writes its self, ``out=`` is written and not read, a list op in place writes the list
    it does not return; views and fresh empty tensors move nothing. fp32, 1,000 elements: 4,000 bytes each."""
    import torch

    from zbench.plan.trace.ops import OpLedger

    ledger = OpLedger()
    a, b, out = torch.ones(1000), torch.ones(1000), torch.empty(1000)
    with ledger:
        ledger.start_step()
        a.add_(b)
        torch.add(a, b, out=out)
        torch._foreach_add_([a, b], [out, out])
        a.view(10, 100).t()
        torch.empty(1000)
    moved = {e["op"]: e["bytes"] for e in ledger.take()["after_backward"]}
    assert moved == {"add_": 12000, "add": 12000, "_foreach_add_": 24000}


def test_the_ledger_counts_the_large_tensors_an_operator_creates():
    """Bytes a CPU rank maps fresh: each tensor an operator creates of at least the pinned mmap threshold (an
    output of ``add``; a large ``empty``, kept for them alone), never a small one, a view or an in-place result."""
    import torch

    from zbench.measure.memory import CPU_MMAP_THRESHOLD_BYTES
    from zbench.plan.trace.ops import OpLedger

    n = CPU_MMAP_THRESHOLD_BYTES // 4  # fp32: exactly the threshold
    ledger = OpLedger()
    big, small = torch.ones(n), torch.ones(n // 2)
    with ledger:
        ledger.start_step()
        big.add_(big)
        torch.add(big, big)
        torch.add(small, small)
        torch.empty(n)
        torch.empty(n // 2)
        big.view(2, -1)
    mapped = {(e["op"], e["shapes"][0][0]): (e["bytes"], e["mapped_bytes"]) for e in ledger.take()["after_backward"]}
    assert mapped == {
        ("add_", n): (3 * 4 * n, 0),
        ("add", n): (3 * 4 * n, 4 * n),
        ("add", n // 2): (3 * 2 * n, 0),
        ("empty", n): (0, 4 * n),
    }


def test_a_storage_grown_in_place_is_mapped_as_an_allocation_is_and_put_back_after():
    """FSDP2 frees its unsharded parameters with ``untyped_storage().resize_(0)`` and grows them again for the next
    all-gather, out of a dispatch mode's sight: the ledger counts each growth of at least the mmap threshold as
    mapped bytes (by how much it grew), a shrink or a small growth as nothing, on real and fake tensors, and
    puts ``resize_`` back when it exits, an exception or not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zbench.measure.memory import CPU_MMAP_THRESHOLD_BYTES
    from zbench.plan.trace.ops import OpLedger

    n = CPU_MMAP_THRESHOLD_BYTES
    plain = torch.UntypedStorage.resize_
    ledger = OpLedger()
    storage = torch.empty(n, dtype=torch.uint8).untyped_storage()
    with ledger:
        ledger.start_step()
        storage.resize_(0)
        storage.resize_(2 * n)  # freed, then grown: all of it mapped afresh
        storage.resize_(2 * n + 16)  # a small growth
        with FakeTensorMode():
            torch.empty(n, dtype=torch.uint8).untyped_storage().resize_(3 * n)
    entries = [e for e in ledger.take()["after_backward"] if e["op"] == "resize_"]
    assert sorted((e["mapped_bytes"], e["bytes"], e["count"]) for e in entries) == [(2 * n, 0, 1), (2 * n, 0, 1)]
    assert torch.UntypedStorage.resize_ is plain
    with pytest.raises(RuntimeError), OpLedger():
        raise RuntimeError("a failing step")
    assert torch.UntypedStorage.resize_ is plain
    storage.resize_(0)


def test_fsdp2_maps_its_unsharded_parameters_afresh_at_each_unshard_and_ddp_never(traced):
    """FSDP2 at stage 3 gathers every unit in forward and again in backward (reshard after forward), each time into
    storage it grew back from nothing: forward maps the whole model's parameters (fp32, the units of at least the
    mmap threshold), DDP, whose parameters stay, maps none."""
    from zbench.cases.model_source import model_info

    def grown(run: str, phase: str) -> int:
        return sum(e["mapped_bytes"] * e["count"] for e in traced[run]["ops"].get(phase, []) if e["op"] == "resize_")

    assert grown("fsdp-False", "forward") == pytest.approx(4 * model_info("small").parameters, rel=0.02)
    assert grown("fsdp-False", "backward") > 0
    assert grown("ddp-False", "forward") == grown("ddp-False", "backward") == 0


def test_a_rank_with_more_threads_does_its_operators_work_faster_not_their_dispatch_or_its_host_work():
    """Two threads where the calibration had one: the work of each operator at ``share`` 2, its per-call cost
    and the implementation's host work as calibrated; half a core (four ranks on two): everything twice as long."""
    from zbench.plan.simulate.calibration import ImplementationOverhead
    from zbench.plan.simulate.compute import case_phase_seconds
    from zbench.plan.trace.plan import make_case

    host = ImplementationOverhead(per_step_us=1000, per_block_us=0, residuals_us={})
    cal = _calibration().model_copy(update={"overheads": {"ddp-s0": host}})
    add = {"op": "add", "dtype": "float32", "flops": 0, "bytes": 3e6, "count": 5}
    assert op_seconds(add, cal, on_gpu=False, share=2) == pytest.approx(5 * (3e6 / 10e9 / 2 + 2e-6))
    assert op_seconds(add, cal, on_gpu=False, share=0.5) == pytest.approx(2 * op_seconds(add, cal, on_gpu=False))
    case = make_case("small", "ddp", 0, "none", gpus=1, precision="fp32", micro_batch=2, seq_len=64, device="cpu",
                     checkpointing=False)  # fmt: skip
    ops = {"after_backward": [add]}
    assert case_phase_seconds(ops, cal, case, world=1, cores=2)["after_backward"] == pytest.approx(
        5 * (3e6 / 10e9 / 2 + 2e-6) + 1e-3
    )
    assert case_phase_seconds(ops, cal, case, world=4, cores=2)["after_backward"] == pytest.approx(
        2 * case_phase_seconds(ops, cal, case, world=1)["after_backward"]
    )


def test_an_implementations_host_work_is_its_residual_over_its_operators():
    """Each probe's measured step less its operators' charge, through the two depths: planted residuals of
    1 ms + 0.5 ms per block come back out, whatever the operators cost; the simulator adds them for the case's
    implementation and stage and nothing for one not measured, never a negative time."""
    from zbench.plan.calibrate.overheads import NARROW, fit
    from zbench.plan.simulate.compute import implementation_seconds, op_seconds

    cal = _calibration()
    matmul = {"op": "mm", "dtype": "float32", "flops": 2e6, "bytes": 0, "count": 3}
    charged = op_seconds(matmul, cal, on_gpu=False)
    probes = [
        {
            "key": "fsdp-s3",
            "blocks": blocks,
            "width": NARROW,
            "seconds": charged + 1e-3 + 0.5e-3 * blocks,
            "ops": [matmul],
        }
        for blocks in (2, 6)
    ] + [{"key": "ddp-s0", "blocks": blocks, "width": NARROW, "seconds": 0.0, "ops": [matmul]} for blocks in (2, 6)]
    wide = {"blocks": 2, "width": 512, "seconds": 0.25, "ops": [matmul]}  # the operator model's error is not fitted
    overheads = fit([*probes, {"key": "fsdp-s3", **wide}, {"key": "ddp-s0", **wide}], cal)  # fmt: skip
    assert overheads["fsdp-s3"].per_step_us == pytest.approx(1000) and overheads["fsdp-s3"].per_block_us == 500
    assert overheads["fsdp-s3"].residuals_us == {"2": pytest.approx(2000), "6": pytest.approx(4000)}
    assert overheads["fsdp-s3"].measured_us == pytest.approx(  # every probe's step kept, for estimates' differences
        {"2": (charged + 2e-3) * 1e6, "6": (charged + 4e-3) * 1e6, "2x512": 250_000}
    )
    with_them = cal.model_copy(update={"overheads": overheads})
    assert implementation_seconds(with_them, "fsdp", 3, 32) == pytest.approx(1e-3 + 32 * 0.5e-3)
    assert implementation_seconds(with_them, "fsdp", 2, 32) == 0.0  # not measured at that stage
    assert implementation_seconds(with_them, "ddp", 0, 32) == 0.0  # over-charged operators: no negative time
    assert implementation_seconds(cal, "fsdp", 3, 32) == 0.0  # an older calibration


def test_what_an_implementations_wide_probe_takes_beyond_ddps_is_charged_per_parameter_element():
    """The wide probe's remainder (its step less its operators and its narrow fit at its depth) over DDP's, per
    element of the probe: planted 13 ms for FSDP2 and -3 ms for zero1 come back out; DDP's own remainder, the
    operator model's error at that width, is charged to nobody; the simulator charges the term on the case's
    whole parameters. Planted bugs this catches: DDP's remainder not taken off (every term 8 ms higher), the narrow
    fit not taken off (FSDP2's 4 ms higher than DDP's at two blocks read as per-element work)."""
    from zbench.cases.model_source import model_info
    from zbench.plan.calibrate.overheads import NARROW, PROBES, fit, label, probe_shapes
    from zbench.plan.simulate.compute import case_phase_seconds, implementation_seconds
    from zbench.plan.trace.plan import make_case

    cal = _calibration()
    blocks, width, _ = PROBES[-1]
    _, elements = probe_shapes()[label(blocks, width)]
    common = 0.008  # the operator model's error at the wide shapes, in every implementation's step
    narrow_fit = {"ddp-s0": (1e-3, 0.2e-3), "fsdp-s2": (2e-3, 3e-3), "zero1-s1": (0.5e-3, 0.9e-3)}
    beyond_ddp = {"ddp-s0": 0.0, "fsdp-s2": 0.013, "zero1-s1": -0.003}
    probes = [
        {"key": key, "blocks": depth, "width": NARROW, "seconds": per_step + per_block * depth, "ops": []}
        for key, (per_step, per_block) in narrow_fit.items() for depth in (2, 6)
    ] + [
        {"key": key, "blocks": blocks, "width": width, "ops": [],
         "seconds": per_step + per_block * blocks + common + beyond_ddp[key]}
        for key, (per_step, per_block) in narrow_fit.items()
    ]  # fmt: skip
    overheads = fit(probes, cal)
    assert {k: o.per_element_us * elements * 1e-6 for k, o in overheads.items()} == pytest.approx(beyond_ddp)
    with_them = cal.model_copy(update={"overheads": overheads})
    fsdp = overheads["fsdp-s2"]
    assert implementation_seconds(with_them, "fsdp", 2, 4, 10**6) == pytest.approx(
        (fsdp.per_step_us + 4 * fsdp.per_block_us + 10**6 * fsdp.per_element_us) * 1e-6
    )
    assert implementation_seconds(with_them, "ddp", 0, 4, 10**9) == implementation_seconds(with_them, "ddp", 0, 4)
    case = make_case("small", "fsdp", 2, "none", gpus=2, precision="fp32", micro_batch=2, seq_len=64, device="cpu",
                     checkpointing=False)  # fmt: skip
    info = model_info("small")
    charged = case_phase_seconds({}, with_them, case, world=2)["after_backward"]
    assert charged == pytest.approx(implementation_seconds(with_them, "fsdp", 2, 4, info.parameters))
    assert charged - implementation_seconds(with_them, "fsdp", 2, 4) == pytest.approx(  # the whole model, not a shard
        0.013 * info.parameters / elements
    )
    without_ddp = fit([p for p in probes if p["key"] != "ddp-s0"], cal)
    assert all(o.per_element_us == 0 for o in without_ddp.values())  # no reference, no term


def test_the_reference_engines_reduce_scatter_is_charged_as_the_all_reduce_it_issues_on_gloo():
    """On gloo the reference engine reduce-scatters by an in-place all-reduce of the input (gloo's own
    reduce-scatter clones the input first: 1.6x the time at 16 MiB here), so a profile calibrated over gloo charges
    its traced reduce-scatters as that all-reduce, at the ledger's bytes for one (twice the buffer). FSDP2's stay
    gloo's reduce-scatter, and a profile calibrated over NCCL, or a datasheet one, charges the engine's as traced."""
    from zbench.plan.simulate.cluster import load
    from zbench.plan.simulate.sweep import as_issued
    from zbench.plan.trace.plan import make_case

    phases = {
        "backward": {"reduce_scatter": {"count": 3, "bytes": 300}, "all_reduce": {"count": 1, "bytes": 8}},
        "after_backward": {"all_gather": {"count": 2, "bytes": 100}},
    }
    gloo = load("cpu-2core").model_copy(update={"calibration": _calibration()})
    nccl = load("cpu-2core").model_copy(update={"calibration": _calibration().model_copy(update={"backend": "nccl"})})

    def case(implementation: str):
        return make_case("tiny", implementation, 2, "none", gpus=2, precision="fp32", micro_batch=1, seq_len=32,
                         device="cpu", checkpointing=False)  # fmt: skip

    assert as_issued(phases, case("zero2"), gloo) == {
        "backward": {"all_reduce": {"count": 4, "bytes": 8 + 2 * 300}},
        "after_backward": {"all_gather": {"count": 2, "bytes": 100}},
    }
    assert as_issued(phases, case("fsdp"), gloo) == phases
    assert as_issued(phases, case("zero2"), nccl) == phases
    assert as_issued(phases, case("zero2"), load("h100-sxm")) == phases


def test_collectives_an_implementation_waits_for_on_the_profiles_backend_hide_behind_nothing():
    """A CPU profile measures how much of an asynchronous all-reduce hides behind compute (``overlap``). DDP and
    the reference engine issue theirs asynchronously and get it; FSDP1 and FSDP2 call theirs without ``async_op``
    (their overlap is CUDA streams), so on gloo every one is charged in full, forward and backward, whatever their
    options; on NCCL, or a datasheet profile, only their options' serialized phases are."""
    from zbench.plan.simulate.cluster import load
    from zbench.plan.simulate.step import estimate
    from zbench.plan.simulate.sweep import serialized
    from zbench.plan.trace.plan import make_case

    gloo = load("cpu-2core").model_copy(update={"calibration": _calibration(), "overlap": 0.5})
    nccl = gloo.model_copy(update={"calibration": _calibration().model_copy(update={"backend": "nccl"})})

    def case(implementation: str, stage: int, **options: object):
        return make_case("tiny", implementation, stage, "none", gpus=2, precision="fp32", micro_batch=1,
                         seq_len=32, device="cpu", checkpointing=False, options=options)  # fmt: skip

    both = {"forward", "backward"}
    assert serialized(case("fsdp1", 3), gloo) == both and serialized(case("fsdp", 3), gloo) == both
    assert serialized(case("fsdp1", 0), gloo) == both  # NO_SHARD's all-reduce, which no option serializes
    assert serialized(case("fsdp1", 3), nccl) == frozenset() and serialized(case("fsdp1", 3)) == frozenset()
    assert serialized(case("fsdp1", 3, backward_prefetch="post"), nccl) == {"backward"}
    assert serialized(case("ddp", 0), gloo) == frozenset() and serialized(case("zero2", 2), gloo) == frozenset()
    assert serialized(case("zero3", 3, prefetch=0), gloo) == both  # its own option still counts

    phases = {"backward": {"all_reduce": {"count": 4, "bytes": 4_000_000}}}
    kw = dict(cluster=gloo, world=2, flops_per_step=0.0, params=1, stage=0, offload="none", checkpointing=False,
              tokens_per_step=1, phase_compute={"forward": 0.5, "backward": 1.0})  # fmt: skip
    comm = estimate(phases, **kw).comm_s
    hidden = estimate(phases, **kw, serialized=serialized(case("ddp", 0), gloo))
    waited = estimate(phases, **kw, serialized=serialized(case("fsdp1", 0), gloo))
    assert hidden.exposed_comm_s == pytest.approx(comm / 4)  # all but the last bucket hides
    assert waited.exposed_comm_s == pytest.approx(comm) and waited.step_s > hidden.step_s
