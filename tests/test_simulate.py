"""``zbench plan --simulate``: the alpha-beta model by hand, the overlap rule at its edge, one trace serving a sweep."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zbench.plan.simulate.cluster import ClusterError, built_in_names, load
from zbench.plan.simulate.compute import op_seconds
from zbench.plan.simulate.step import collective_seconds, estimate

H100 = load("h100-sxm")
REPO = Path(__file__).resolve().parents[1]


NVLINK_S, NET_S = H100.intra_node.latency_us * 1e-6, H100.inter_node.latency_us * 1e-6
NVLINK_B, NET_B = H100.intra_node.bandwidth_gb_s * 1e9, H100.inter_node.bandwidth_gb_s * 1e9


def test_ring_all_gather_inside_a_node_by_hand():
    s = collective_seconds("all_gather", 1e9, 1, 8, H100)
    assert s == pytest.approx(7 * NVLINK_S + 7 / 8 * 1e9 / NVLINK_B)


def test_across_nodes_the_network_sets_bandwidth_and_each_node_adds_a_network_hop():
    s = collective_seconds("reduce_scatter", 1e9, 2, 32, H100)  # 4 nodes: 27 NVLink hops, 4 network hops per pass
    latency = 2 * (27 * NVLINK_S + 4 * NET_S)
    assert s == pytest.approx(latency + 31 / 32 * 1e9 / NET_B)


def test_all_reduce_takes_the_faster_of_ring_and_tree():
    many_small = collective_seconds("all_reduce", 1e6, 1000, 1024, H100)
    tree = 1000 * 2 * (3 * NVLINK_S + 7 * NET_S) + 1e6 / NET_B
    assert many_small == pytest.approx(tree)  # latency-bound: log-depth tree wins
    one_big = collective_seconds("all_reduce", 1e10, 1, 16, H100)
    ring = 2 * (13 * NVLINK_S + 2 * NET_S) + 15 / 16 * 1e10 / NET_B
    assert one_big == pytest.approx(ring)  # bandwidth-bound: the ring's (p-1)/p wins


def test_one_rank_sends_nothing():
    assert collective_seconds("all_gather", 1e9, 5, 1, H100) == 0.0


def _zero3_like(gather_bytes: float, calls: int) -> dict:
    return {"forward": {"all_gather": {"count": calls, "bytes": int(gather_bytes)}}}


@pytest.mark.parametrize("factor, hidden", [(0.9, True), (1.1, False)])
def test_overlap_hides_forward_gathers_up_to_forward_compute_and_no_further(factor, hidden):
    """A planted edge: forward gathers whose hideable part is 0.9x / 1.1x forward compute."""
    cluster = H100.model_copy(update={"overlap": 1.0})
    flops = 3 * 1e12  # forward = 1e12 FLOPs
    forward_s = 1e12 / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    calls = 10
    one_call = forward_s * factor / (calls - 1)  # every call but the first hides
    per_call_latency = collective_seconds("all_gather", 0, 1, 8, cluster)
    gather_bytes = calls * (one_call - per_call_latency) * NVLINK_B * 8 / 7
    est = estimate(
        _zero3_like(gather_bytes, calls), cluster=cluster, world=8, flops_per_step=flops, params=1,
        stage=3, offload="none", checkpointing=False, tokens_per_step=1,
    )  # fmt: skip
    assert est.hides_gathers is hidden
    exposed_beyond_one_call = est.exposed_comm_s - est.comm_s / calls
    assert exposed_beyond_one_call == pytest.approx(max(0.0, (factor - 1) * forward_s), rel=1e-6, abs=1e-9)
    assert est.step_s == pytest.approx(est.compute_s + est.exposed_comm_s)


def test_what_comes_after_backward_is_never_hidden():
    phases = {"after_backward": {"all_gather": {"count": 1, "bytes": 10**9}}}
    est = estimate(
        phases, cluster=H100, world=8, flops_per_step=1e15, params=1, stage=1, offload="none",
        checkpointing=False, tokens_per_step=1,
    )  # fmt: skip
    assert est.exposed_comm_s == pytest.approx(est.comm_s) and est.comm_s > 0


def test_offload_adds_host_step_and_pcie_time():
    kw = dict(cluster=H100, world=8, flops_per_step=1e12, params=8 * 10**9, stage=2, checkpointing=False,
              tokens_per_step=1)  # fmt: skip
    plain, off = estimate({}, offload="none", **kw), estimate({}, offload="optimizer", **kw)
    shard = 10**9
    assert off.offload_s == pytest.approx(8 * shard / (H100.pcie_gb_s * 1e9) + shard / H100.host_adam_params_per_s)
    assert off.step_s == pytest.approx(plain.step_s + off.offload_s)


def test_on_a_cpu_the_traced_operators_are_the_host_step_and_only_nvme_is_added():
    """A CPU's host is its device: with operator compute (whose traced optimizer step is the host's, charged by
    ``phase_seconds``) the offload model adds no host AdamW and no copies, only NVMe's reads and writes. Without
    operator compute (FLOPs x efficiency) it still charges the host step, which nothing else does."""
    cpu = load("cpu-2core")
    kw = dict(cluster=cpu, world=2, flops_per_step=1e9, params=2 * 10**6, stage=2, checkpointing=False,
              tokens_per_step=1)  # fmt: skip
    shard = 10**6
    traced = {"phase_compute": {"forward": 0.1, "backward": 0.2, "after_backward": 0.05}}
    assert estimate({}, offload="optimizer", **kw, **traced).offload_s == 0.0
    nvme = estimate({}, offload="nvme", **kw, **traced)
    assert nvme.offload_s == pytest.approx(2 * 12 * shard / (cpu.nvme_gb_s_per_node * 1e9 / 2))
    assert nvme.step_s == pytest.approx(0.35 + nvme.offload_s)
    untraced = estimate({}, offload="optimizer", **kw)
    assert untraced.offload_s == pytest.approx(8 * shard / (cpu.pcie_gb_s * 1e9) + shard / cpu.host_adam_params_per_s)


def test_a_datasheet_profile_charges_each_operator_from_its_published_rates():
    """h100-sxm's ``operators:``: a product at the achievable rate of its dtype, fused attention at its kernel's
    quoted rate, an elementwise operator at the memory bandwidth, a tiny one at its launch; a profile without
    them has no operator rates (FLOPs x efficiency)."""
    rates = H100.operator_rates()
    figures = H100.operators
    assert rates is not None and figures is not None
    product = {"op": "mm", "flops": 2e12, "bytes": 0, "dtype": "bfloat16", "count": 3}
    bf16_rate = figures.matmul_tflops["bfloat16"] * 1e12
    assert op_seconds(product, rates, on_gpu=True) == pytest.approx(3 * 2e12 / bf16_rate)
    fp32 = product | {"dtype": "float32"}
    assert op_seconds(fp32, rates, on_gpu=True) == pytest.approx(3 * 2e12 / (figures.matmul_tflops["float32"] * 1e12))
    attention = product | {"op": "_scaled_dot_product_flash_attention_for_cpu"}
    assert op_seconds(attention, rates, on_gpu=True) == pytest.approx(3 * 2e12 / (figures.attention_tflops * 1e12))
    assert figures.attention_tflops < figures.matmul_tflops["bfloat16"]
    norm = {"op": "native_layer_norm", "flops": 0, "bytes": 3e9, "dtype": "bfloat16", "count": 2}
    assert op_seconds(norm, rates, on_gpu=True) == pytest.approx(2 * 3e9 / (figures.memory_gb_s * 1e9))
    tiny = {"op": "add", "flops": 0, "bytes": 64, "dtype": "bfloat16", "count": 100}
    assert op_seconds(tiny, rates, on_gpu=True) == pytest.approx(100 * figures.launch_us * 1e-6)
    assert H100.model_copy(update={"operators": None}).operator_rates() is None
    assert rates.device == H100.gpu and not H100.on_cpu()
    own_cpu = H100.model_copy(update={"gpu": "CPU core (fp32)"})  # a user's datasheet for CPU cores
    assert own_cpu.on_cpu() and own_cpu.operator_rates().device == "cpu"  # charged as the host, as the step is


def test_cluster_files_are_checked(tmp_path):
    assert {"h100-sxm", "a100-sxm", "rtx4090-pcie", "cpu-2core"} <= set(built_in_names())
    bad = tmp_path / "c.yaml"
    bad.write_text(H100.model_dump_json().replace('"peak_tflops":989.0', '"peak_tflops":-1'))
    with pytest.raises(ClusterError, match="peak_tflops"):
        load(str(bad))
    with pytest.raises(ClusterError, match="unknown cluster"):
        load("nope")


def test_simulate_cli_sweeps_from_one_trace_and_says_where_hiding_stops(cli, tmp_path):
    own = tmp_path / "mine.yaml"
    own.write_text(H100.model_copy(update={"name": "mine", "inter_node": H100.inter_node}).model_dump_json())
    r = cli("plan", "--simulate", str(own), "--model", "tiny", "-i", "zero3", "-i", "ddp", "-o", "none",
            "--scale", "8", "--scale", "1024", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    document = json.loads(r.stdout)
    assert "46 published" in document["measured_error"]  # a datasheet profile's predictions, with their error
    rows = {row["implementation"]: row for row in document["rows"]}
    for row in rows.values():
        assert row["error"] is None and row["traced_at"] == 8
        at = {e["world"]: e for e in row["estimates"]}
        assert at[1024]["tokens_per_s_per_gpu"] < at[8]["tokens_per_s_per_gpu"]
        assert math.isclose(at[8]["step_s"], at[8]["compute_s"] + at[8]["exposed_comm_s"] + at[8]["offload_s"])
    assert rows["zero3"]["stops_hiding_at"] in (8, 1024)  # tiny: latency-bound, gathers cannot hide
    assert {e["compute_model"] for row in rows.values() for e in row["estimates"]} == {"operators"}


@pytest.mark.heavy
def test_one_trace_serves_every_world_size(cli):
    """The per-rank volumes a trace records do not depend on the world size: traced at 8 and at 64, the
    predictions at 1,024 agree (within the flat buffers' padding)."""
    preds = []
    for gpus in ("8", "64"):
        r = cli("plan", "--simulate", "h100-sxm", "--model", "tiny", "-i", "zero3", "-o", "none", "--gpus", gpus,
                "--scale", "1024", "--json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        est = {e["world"]: e for e in json.loads(r.stdout)["rows"][0]["estimates"]}
        preds.append(est[1024]["step_s"])
    assert preds[0] == pytest.approx(preds[1], rel=0.02)


def test_simulate_bad_input(cli):
    r = cli("plan", "--simulate", "nope", "--model", "tiny")
    assert r.returncode == 2 and "unknown cluster" in r.stderr


def test_trace_on_cuda_without_cuda_is_refused_in_one_line(cli):
    from zbench.plan.trace.plan import cuda_traceable

    if cuda_traceable():
        pytest.skip("a GPU is visible: --device cuda traces (tests/test_gpu.py)")
    r = cli("plan", "--trace", "--model", "tiny", "--device", "cuda", "-i", "ddp")
    assert r.returncode == 2 and "--device cuda" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def validated(
    model: str, impl: str, measured_s: float, predicted_s: float, ratio: float, predicted: float, ref: str | None = None
):
    """One case of a validation run (``model-impl`` at world 2): measured and predicted step and ratio to DDP."""
    from zbench.plan.simulate.calibrated import CalibratedPrediction

    return CalibratedPrediction(case_id=f"{model}-{impl}", model=model, implementation=impl, world=2,
                                measured_s=measured_s, predicted_s=predicted_s, comm_s=0.0, measured_ratio=ratio,
                                predicted_ratio=predicted, reference_case=ref)  # fmt: skip


def test_the_measured_ratios_two_readings_are_set_against_each_other_and_the_prediction():
    """validate_simulator reports how far a case's paired ratio to DDP lies from its step medians' ratio: the
    floor under any ratio error it states. A case whose readings agree reads 0; one whose paired rounds read
    20% over its step medians reads +0.2; DDP itself, and a case without its DDP reference, are left out."""
    from tests.benchmarks.validate_simulator import ratio_agreement

    ddp = validated("t", "ddp", 0.010, 1.0, 1.0, 1.0, ref="t-ddp")
    agreeing = validated("t", "zero1", 0.015, 1.0, 1.5, 1.5, ref="t-ddp")
    paired_over = validated("t", "fsdp", 0.030, 1.0, 3.6, 2.7, ref="t-ddp")  # step medians' ratio 3.0
    orphan = validated("t", "zero3", 0.050, 1.0, 9.0, 1.0, ref="gone-ddp")
    out = ratio_agreement([ddp, agreeing, paired_over, orphan])
    assert out["paired_vs_step_medians"] == pytest.approx({"cases": 2, "median_abs": 0.1, "worst_abs": 0.2})
    assert out["predicted_vs_step_medians"] == pytest.approx({"cases": 2, "median_abs": 0.05, "worst_abs": 0.1})
    assert set(out["by_group"]) == {"t-ddp"}
    assert ratio_agreement([ddp, orphan]) == {}


def test_the_repeats_measured_ratios_are_set_against_one_another():
    """validate_simulator states how well its repeats agree among themselves, the floor under a prediction's tau:
    repeats that measured the same ratios agree at tau 1; a repeat that swapped two cases' order, or read one case
    20% high, shows in its pairs and against the others' median; DDP, a case one repeat lacks, and a lone repeat
    are left out."""
    from tests.benchmarks.validate_simulator import repeat_agreement

    def repeat(ratios: dict[str, float]):
        return [validated("t", impl, 0.01, 0.01, ratio, 1.0, ref="t-ddp") for impl, ratio in ratios.items()]

    steady = {"ddp": 1.0, "zero1": 1.1, "zero2": 1.2, "zero3": 1.4, "fsdp": 1.8}
    same = repeat_agreement([repeat(steady)] * 3)
    assert same["cases"] == 4
    agreements = [*same["pairs"].values(), *same["leave_one_out"].values()]
    assert all(v["kendall_tau"] == pytest.approx(1.0) for v in agreements)
    assert same["pairs"]["0 vs 1"]["ratio_difference"]["worst_abs"] == pytest.approx(0.0)

    swapped = repeat({**steady, "zero1": 1.2, "zero2": 1.1, "fsdp": 2.16})  # two cases swapped, fsdp 20% high
    partial = repeat({"zero1": 1.1, "zero2": 1.2, "zero3": 1.4, "fsdp": 1.8})  # no fsdp1, which the others have
    out = repeat_agreement([repeat({**steady, "fsdp1": 1.3}), swapped, repeat({**steady, "fsdp1": 1.3}), partial])
    assert out["cases"] == 4  # fsdp1 is not in every repeat; ddp is never a case
    assert out["pairs"]["0 vs 2"]["kendall_tau"] == pytest.approx(1.0)
    assert out["pairs"]["0 vs 1"]["kendall_tau"] == pytest.approx(2 / 3)  # one discordant pair of six
    assert out["pairs"]["0 vs 1"]["ratio_difference"]["worst_abs"] == pytest.approx(1 / 6)
    assert out["leave_one_out"]["1"]["ratio_difference"]["worst_abs"] == pytest.approx(0.2)
    assert out["leave_one_out"]["0"]["kendall_tau"] == pytest.approx(1.0)
    assert repeat_agreement([repeat(steady)]) == {}
    # against the others' median, never one that counts the repeat itself: 2.16 over median(1.8, 1.98) = 1.89
    three = repeat_agreement([repeat(steady), repeat({**steady, "fsdp": 2.16}), repeat({**steady, "fsdp": 1.98})])
    assert three["leave_one_out"]["1"]["ratio_difference"]["worst_abs"] == pytest.approx(2.16 / 1.89 - 1)


def test_validation_errors_are_summarised_over_all_cases_and_per_model():
    from tests.benchmarks.validate_simulator import summarise

    cases = [
        validated("tiny", "ddp", 0.010, 0.006, 1.0, 1.0),  # step -40%
        validated("tiny", "fsdp", 0.036, 0.014, 3.6, 2.4),  # ratio -33%
        validated("tiny", "zero1", 0.013, 0.007, 1.3, 1.2),
        validated("small", "ddp", 0.200, 0.180, 1.0, 1.0),  # step -10%
        validated("small", "fsdp", 0.280, 0.252, 1.4, 1.33),  # ratio -5%
        validated("small", "zero1", 0.210, 0.189, 1.05, 1.05),
    ]
    out = summarise(cases)
    assert out["ratio"]["cases"] == 4 and out["ratio"]["worst_abs"] == pytest.approx(1 / 3)
    assert out["per_model"]["small"]["step"]["worst_abs"] == pytest.approx(0.10)
    assert out["per_model"]["small"]["ratio"] == pytest.approx({"cases": 2, "median_abs": 0.025, "worst_abs": 0.05})
    assert out["per_model"]["tiny"]["ratio"]["worst_abs"] == pytest.approx(1 / 3)
    assert out["per_model"]["small"]["kendall_tau_ratio"] == pytest.approx(1.0)
    assert set(out["per_implementation"]) == {"ddp", "fsdp", "zero1"}


def test_predicting_a_directory_without_kept_runs_says_so_in_one_line(tmp_path):
    """``validate_simulator --predict DIR`` on a directory that holds no sitting's runs (a typo, the wrong folder)
    stops with the directory named, not a traceback from deep in the trace."""
    from tests.benchmarks.validate_simulator import predict_sitting

    (tmp_path / "rep").mkdir()  # a report folder alone is no run
    with pytest.raises(SystemExit, match="no kept runs"):
        predict_sitting(tmp_path, {"before": [[tmp_path / "before.yaml"]]})


def test_each_repeat_is_predicted_from_the_calibrations_on_either_side_of_it(tmp_path):
    """A sitting that calibrated between its repeats predicts repeat i from calibrations i and i+1 (``bracketing``),
    and every repeat from the first or the last alone; one kept before then, from its before and after profiles;
    a count of calibrations that does not bracket the repeats is refused rather than paired off wrongly; profiles
    the user names each predict every repeat. Calibration 10 sorts after 9, not after 1."""
    from tests.benchmarks.validate_simulator import schemes_for

    cals = [tmp_path / f"cal{i}.yaml" for i in range(12)]
    for f in cals:
        f.write_text("")
    schemes = schemes_for(tmp_path, 11)
    assert schemes["bracketing"][0] == cals[0:2] and schemes["bracketing"][9] == [cals[9], cals[10]]
    assert schemes["first"] == [[cals[0]]] * 11 and schemes["last"] == [[cals[11]]] * 11
    with pytest.raises(SystemExit, match="12 calibrations for 2 repeats"):
        schemes_for(tmp_path, 2)
    older = tmp_path / "older"
    older.mkdir()
    assert schemes_for(older, 2) == {"before": [[older / "before.yaml"]] * 2, "after": [[older / "after.yaml"]] * 2}
    assert schemes_for(tmp_path, 2, [tmp_path / "mine.yaml"]) == {"mine": [[tmp_path / "mine.yaml"]] * 2}


def test_predictions_from_two_calibrations_meet_at_their_geometric_mean():
    """A repeat predicted from the calibrations before and after it takes each case's geometric mean: 0.1 s and
    0.4 s give 0.2 s (an arithmetic mean, 0.25 s, would weigh the slower reading more; the geometric mean of the
    rates gives the same step). A case one calibration could not predict is left out, not half-averaged."""
    from tests.benchmarks.validate_simulator import geometric_mean

    before = [validated("t", "ddp", 0.3, 0.1, 1.0, 1.0), validated("t", "zero3", 0.6, 0.2, 2.0, 1.5)]
    after = [validated("t", "ddp", 0.3, 0.4, 1.0, 1.0)]
    (ddp,) = geometric_mean([before, after])
    assert ddp.predicted_s == pytest.approx(0.2) and ddp.predicted_ratio == pytest.approx(1.0)
    assert geometric_mean([before]) == before


def test_a_case_is_judged_by_its_median_prediction_against_its_median_measurement():
    """Over the repeats, each case's prediction (per repeat, from that repeat's calibrations) and its measured step
    and ratio are each the median of the repeats', never the first repeat's alone."""
    from tests.benchmarks.validate_simulator import over_repeats

    readings = [(0.5, 0.30, 1.5), (0.4, 0.10, 1.9), (0.6, 0.2, 1.7)]  # measured s, predicted s, predicted ratio
    runs = [[validated("t", "zero3", m, p, 2.0, r)] for m, p, r in readings]
    (case,), spread = over_repeats(runs)
    assert (case.measured_s, case.predicted_s, case.predicted_ratio) == pytest.approx((0.5, 0.2, 1.7))
    assert spread == {"t-zero3": pytest.approx(1.5)}


@pytest.mark.parametrize(
    ("options", "named"),
    [(["--predict", "kept", "--models", "[tiny]", "--repeats", "5"], "--models, --repeats unused"),
     (["--profile", "mine.yaml"], "give it with --predict DIR")],
)  # fmt: skip
def test_options_that_cannot_act_are_refused_in_one_line(tmp_path, options, named):
    """``--predict`` re-predicts kept runs, so a suite option beside it would silently change nothing (the kept
    suite says what ran), and ``--profile`` without ``--predict`` would be ignored by a sitting that calibrates its
    own: each is refused with exit 2 and the options named, before anything runs."""
    command = [sys.executable, "-m", "tests.benchmarks.validate_simulator", *options]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr.splitlines()[-1]
