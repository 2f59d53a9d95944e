"""One real suite run (CPU, gloo, world 2) through the CLI, then everything it wrote is checked.

The suite mixes real implementations with deliberately broken ones so that a
single launch of the CLI covers: equivalence passing and failing, a crashing
rank, an out-of-memory rank, a skipped combination, result files, the pandas
loader and the HTML report. A hung collective (timeout) runs beside it as a
suite of its own, with a short timeout: the main suite's cases get a generous
one, so that a loaded machine slows them without timing them out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.conftest import is_rank_process, zbench, zbench_many
from zbench.results import store
from zbench.results.record import SCHEMA_VERSION

FAULTY = "tests.plugins.faulty:FAULTY"
SUITE = f"""
name: integration
description: real implementations next to broken ones
device: cpu
models: tiny
world_sizes: 2
steps: 8
warmup_steps: 2
timeout_s: 300
precisions: [fp32, fp16]
target_loss: 5.6
implementations:
  - ddp
  - {{name: fsdp, stages: [3]}}
  - torch_zero
  - {{name: "{FAULTY}", options: {{fault: unsynced}}}}
  - {{name: "{FAULTY}", options: {{fault: crash}}}}
  - {{name: "{FAULTY}", options: {{fault: oom}}}}
  - {{name: "{FAULTY}", options: {{fault: sigkill}}}}
  - {{name: "{FAULTY}", options: {{fault: abort_at_exit}}}}
"""


HANG_TIMEOUT_S = 30
HANG_SUITE = f"""
name: hang
device: cpu
models: tiny
world_sizes: 2
steps: 8
warmup_steps: 2
timeout_s: {HANG_TIMEOUT_S}
implementations: [{{name: "{FAULTY}", options: {{fault: hang}}}}]
"""


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    """The main suite and the hang suite, launched at once (each its own CLI process and results directory)."""
    tmp = tmp_path_factory.mktemp("suite")
    (tmp / "suite.yaml").write_text(SUITE)
    (tmp / "hang.yaml").write_text(HANG_SUITE)
    results = zbench_many([
        ["run", str(tmp / "suite.yaml"), "--results", str(tmp / "results"), "--report", str(tmp / "report")],
        ["run", str(tmp / "hang.yaml"), "--results", str(tmp / "hang-results"), "--report", str(tmp / "hang-report")],
    ], timeout=900)  # fmt: skip
    out = []
    for result, name in zip(results, ("results", "hang-results")):
        runs = list((tmp / name).iterdir())
        assert len(runs) == 1, result.stderr
        out.append((result, tmp, runs[0]))
    return out


@pytest.fixture(scope="module")
def suite_run(both_runs):
    return both_runs[0]


@pytest.fixture(scope="module")
def hung_run(both_runs):
    return both_runs[1]


def cases(run_dir: Path) -> dict[str, dict]:
    return {
        c["config"]["implementation"]
        + ":"
        + str(c["config"]["options"].get("fault", ""))
        + ":"
        + c["config"]["precision"]: c
        for c in map(lambda p: json.loads(p.read_text()), (run_dir / "cases").glob("*.json"))
    }


def test_exit_code_is_1_because_broken_cases_fail(suite_run):
    result, _, _ = suite_run
    assert result.returncode == 1, result.stderr
    assert "failed or diverged from DDP" in result.stderr
    assert "Traceback" not in result.stderr


def test_progress_names_every_case(suite_run):
    result, _, run_dir = suite_run
    total = len(list((run_dir / "cases").glob("*.json")))
    for i in range(1, total + 1):
        assert f"[{i}/{total}]" in result.stderr


def test_real_implementations_are_ok_and_equivalent(suite_run):
    _, _, run_dir = suite_run
    c = cases(run_dir)
    for key in ("ddp::fp32", "fsdp::fp32", "torch_zero::fp32"):
        case = c[key]
        assert case["status"] == "ok", case.get("error")
        eq = case["equivalence"]
        assert eq["equivalent"] is True, eq
        assert eq["max_rel_loss_diff"] <= 1e-5 and eq["max_rel_param_diff"] <= 1e-5
        assert len(case["steps"]) == 8 and sum(s["warmup"] for s in case["steps"]) == 2
        assert case["summary"]["step_time_median_s"] > 0
        assert case["ratio_to_ddp"] > 0
        assert case["memory"]["kind"] == "rss" and case["memory"]["peak_bytes"] > 10 * 2**20
        assert case["schema_version"] == SCHEMA_VERSION


def test_loss_actually_falls(suite_run):
    _, _, run_dir = suite_run
    steps = cases(run_dir)["ddp::fp32"]["steps"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05


def test_broken_implementation_is_caught(suite_run):
    _, _, run_dir = suite_run
    case = cases(run_dir)[f"{FAULTY}:unsynced:fp32"]
    assert case["status"] == "ok"
    assert case["equivalence"]["equivalent"] is False
    assert case["equivalence"]["max_rel_param_diff"] > 1e-5
    failed = {c["name"] for c in case["equivalence"]["checks"] if c["passed"] is False}
    assert {"loss", "parameters", "ranks"} <= failed, case["equivalence"]["reason"]  # rank 1 drifts from rank 0
    assert "ranks [1] differ from rank 0" in case["equivalence"]["reason"]


@pytest.mark.parametrize(
    "fault, status, text",
    [
        ("crash", "error", "injected failure on purpose"),
        ("oom", "oom", "allocate"),
        ("sigkill", "error", "rank 1 killed by signal SIGKILL"),
    ],
)
def test_failures_are_recorded_and_the_suite_goes_on(suite_run, fault, status, text):
    _, _, run_dir = suite_run
    case = cases(run_dir)[f"{FAULTY}:{fault}:fp32"]
    assert case["status"] == status
    assert text in case["error"]
    assert case["stderr_tail"]


def test_crash_during_shutdown_keeps_results_with_a_warning(suite_run):
    _, _, run_dir = suite_run
    case = cases(run_dir)[f"{FAULTY}:abort_at_exit:fp32"]
    assert case["status"] == "ok" and case["equivalence"]["equivalent"]
    assert case["warnings"] == ["rank 1 killed by signal SIGABRT after writing its results (during shutdown)"]


def test_hung_collective_times_out_and_leaves_no_orphan_rank(hung_run):
    result, tmp, run_dir = hung_run
    assert result.returncode == 1, result.stderr
    case = cases(run_dir)[f"{FAULTY}:hang:fp32"]
    assert case["status"] == "timeout"
    assert f"timed out after {HANG_TIMEOUT_S} s" in case["error"]
    assert "timeout" in (tmp / "hang-report" / "index.html").read_text()
    assert len(case["rank_pids"]) == 2
    for pid in case["rank_pids"]:
        assert not is_rank_process(pid), f"rank pid {pid} survived its case's timeout"
    assert "Thread" in case["stderr_tail"] or "File " in case["stderr_tail"]  # the stacks dumped before the kill


def test_unsupported_combination_is_skipped_with_reason(suite_run):
    _, _, run_dir = suite_run
    case = cases(run_dir)["fsdp::fp16"]
    assert case["status"] == "skipped"
    assert "precision fp16 not supported" in case["skip_reason"]


def test_ddp_fp16_runs_with_loss_scaling(suite_run):
    _, _, run_dir = suite_run
    case = cases(run_dir)["ddp::fp16"]
    assert case["status"] == "ok", case.get("error")
    assert "loss_scale" in case["steps"][0]["metrics"]


def test_model_state_matches_formula(suite_run):
    _, _, run_dir = suite_run
    c = cases(run_dir)
    for key in ("ddp::fp32", "torch_zero::fp32", "fsdp::fp32"):
        state = c[key]["model_state"]
        assert abs(state["error_rel"]) < 0.02, (key, state["measured"], state["expected"])
    ddp_total = c["ddp::fp32"]["model_state"]["measured_total"]
    assert c["fsdp::fp32"]["model_state"]["measured_total"] < 0.55 * ddp_total


def test_communication_ledger_matches_theory(suite_run):
    _, _, run_dir = suite_run
    c = cases(run_dir)
    psi = c["ddp::fp32"]["model_parameters"]
    for key, design in (("ddp::fp32", 2), ("torch_zero::fp32", 2), ("fsdp::fp32", 3)):
        comms = c[key]["comms"]
        assert abs(comms["error_rel"]) <= 0.05, (key, comms)
        assert comms["design_elements"] == design * psi
    assert c["ddp::fp32"]["comms"]["elements_per_step"] == 2 * psi  # one all-reduce of every gradient
    by_op = c["fsdp::fp32"]["comms"]["by_op"]
    # and the gradient norm's one scalar a step, summed over the shards (implementations/_common.py)
    assert set(by_op) == {"all_gather (float32)", "reduce_scatter (float32)", "all_reduce (float64)"}
    assert by_op["all_reduce (float64)"]["elements"] * 1000 < psi


def test_step_split_and_communication_to_compute_ratio(suite_run):
    """Forward/backward/optimizer come from hooks every implementation triggers; they add up to the step."""
    _, _, run_dir = suite_run
    c = cases(run_dir)
    for key in ("ddp::fp32", "fsdp::fp32", "torch_zero::fp32"):
        ph, cm = c[key]["phases"], c[key]["comms"]
        assert ph["clock"] == "perf_counter" and ph["device_step_s"] is None
        assert ph["forward_s"] > 0 and ph["backward_s"] > 0 and ph["optimizer_s"] > 0, (key, ph)
        for step in c[key]["steps"]:
            parts = step["forward_s"] + step["backward_s"] + step["optimizer_s"]
            assert parts <= step["step_time_s"] * 1.01  # the split lies inside the barrier-bracketed step
        assert cm["bus_bandwidth_bytes_per_s"] > 0
        assert cm["est_time_s"] == pytest.approx(cm["bytes_per_step"] / cm["bus_bandwidth_bytes_per_s"])
        assert cm["comm_to_compute"] == pytest.approx(cm["est_time_s"] / (ph["forward_s"] + ph["backward_s"]))


def test_derived_figures_and_time_to_target(suite_run):
    _, _, run_dir = suite_run
    case = cases(run_dir)["ddp::fp32"]
    assert case["throughput"]["tflops_per_rank"] > 0 and case["throughput"]["mfu"] is None  # no peak on a CPU
    assert case["energy"]["available"] is False and case["energy"]["reason"] == "CPU run"
    ttt = case["time_to_target"]
    assert ttt["reached"] and 1 <= ttt["steps"] <= 8 and ttt["seconds"] > 0


def test_run_json_records_environment(suite_run):
    _, _, run_dir = suite_run
    info = json.loads((run_dir / "run.json").read_text())
    assert info["schema_version"] == SCHEMA_VERSION
    assert info["environment"]["torch"] == torch.__version__
    assert info["suite"]["name"] == "integration" and len(info["suite"]["sha256"]) == 64
    assert info["started_at"] and info["ended_at"]


def test_no_temporary_files_left(suite_run):
    _, _, run_dir = suite_run
    assert not [p for p in run_dir.rglob("*") if p.name.startswith(".")]


def test_final_parameters_are_deleted_once_the_verdicts_are_stored(suite_run):
    _, _, run_dir = suite_run
    assert not list((run_dir / "params").iterdir())
    assert all(c.get("params_file") is None for c in cases(run_dir).values())


def test_pandas_loaders(suite_run):
    _, tmp, _ = suite_run
    df = store.load_cases(tmp / "results")
    assert isinstance(df, pd.DataFrame)
    assert set(df["status"]) == {"ok", "error", "oom", "skipped"}
    assert df.loc[(df.implementation == "torch_zero") & (df.precision == "fp32"), "equivalent"].tolist() == [True]
    steps = store.load_steps(tmp / "results")
    assert len(steps) == 8 * (df["status"] == "ok").sum()
    assert {"case_id", "step", "loss", "step_time_s", "warmup"} <= set(steps.columns)


def test_report_is_written_and_self_contained(suite_run):
    _, tmp, _ = suite_run
    html = (tmp / "report" / "index.html").read_text()
    assert "tiny-torch_zero-s1-w2-fp32-none" in html
    assert "NOT EQUIVALENT" in html and "oom" in html and "skipped" in html
    assert 'class="chart-spec"' in html
    sources = re.findall(r'<script src="([^"]+)"', html)  # nothing fetched from the network: only files beside it
    assert sources and all((tmp / "report" / src).is_file() for src in sources) and "<link " not in html


def test_report_command_rerenders(suite_run, tmp_path):
    _, tmp, _ = suite_run
    result = zbench("report", str(tmp / "results"), "--report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "index.html").stat().st_size > 10_000 and list(tmp_path.glob("plotly-*.min.js"))


def test_report_simulate_stores_predictions_beside_the_run_and_shows_them(suite_run, tmp_path):
    """`report --simulate` traces every finished case, predicts its step time, stores simulation.json, renders it."""
    import shutil

    _, _, run_dir = suite_run
    copy = tmp_path / "results"
    shutil.copytree(run_dir.parent, copy, ignore=shutil.ignore_patterns("*.pt"))
    result = zbench("report", str(copy), "--report", str(tmp_path / "rep"), "--simulate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "simulated" in result.stderr and "|error| median" in result.stderr
    sim = json.loads((copy / run_dir.name / "simulation.json").read_text())
    records = {p.stem: json.loads(p.read_text()) for p in (copy / run_dir.name / "cases").glob("*.json")}
    predicted = {p["case_id"]: p for p in sim["predictions"]}
    assert {"tiny-fsdp-s3-w2-fp32-none", "tiny-torch_zero-s1-w2-fp32-none"} <= set(predicted)
    for case_id, p in predicted.items():
        assert p["measured_s"] == records[case_id]["summary"]["step_time_median_s"]
        assert p["predicted_s"] > 0 and p["comm_s"] >= 0
        assert p["error"] == pytest.approx((p["predicted_s"] - p["measured_s"]) / p["measured_s"])
    not_ok = {cid for cid, r in records.items() if r["status"] != "ok"}
    assert not_ok and not_ok <= set(sim["not_predicted"])
    assert all(sim["not_predicted"][cid].startswith("case ") for cid in not_ok)
    errors = [abs(p["error"]) for p in predicted.values() if p["implementation"] != "ddp"]
    assert sim["worst_abs_error"] == pytest.approx(max(errors))

    # A plain re-render shows the stored simulation too: it lives beside the run.
    assert zbench("report", str(copy), "--report", str(tmp_path / "plain")).returncode == 0
    for page in (tmp_path / "rep" / "index.html", tmp_path / "plain" / "index.html"):
        html = page.read_text()
        assert "Simulated step time vs measured" in html
        fsdp = predicted["tiny-fsdp-s3-w2-fp32-none"]
        assert f"{100 * fsdp['error']:+.0f}%" in html
    # The run's own report, rendered before any simulation existed, has no such section.
    assert "Simulated step time" not in (suite_run[1] / "report" / "index.html").read_text()


def test_export_parquet_and_csv_read_back_with_pandas(suite_run, tmp_path):
    _, tmp, run_dir = suite_run
    stored = {p.stem: json.loads(p.read_text()) for p in (run_dir / "cases").glob("*.json")}
    for fmt in ("parquet", "csv"):
        result = zbench("export", str(tmp / "results"), "--format", fmt, "--out", str(tmp_path / fmt))
        assert result.returncode == 0, result.stderr
        read = pd.read_parquet if fmt == "parquet" else pd.read_csv
        cases_ = read(tmp_path / fmt / f"cases.{fmt}")
        steps = read(tmp_path / fmt / f"steps.{fmt}")
        assert set(cases_["case_id"]) == set(stored) and len(cases_) == len(stored)
        assert len(steps) == sum(len(c["steps"]) for c in stored.values())
        ok = "tiny-torch_zero-s1-w2-fp32-none"
        losses = steps[steps["case_id"] == ok].sort_values("step")["loss"].tolist()
        assert losses == pytest.approx([s["loss"] for s in stored[ok]["steps"]], rel=1e-12)
        assert {"error", "oom", "skipped"} <= set(cases_["status"])  # failed and skipped cases too, with their status


def test_export_tensorboard_one_run_per_case(suite_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, tmp, run_dir = suite_run
    result = zbench("export", str(tmp / "results"), "--format", "tensorboard", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    ok = "tiny-fsdp-s3-w2-fp32-none"
    stored = json.loads((run_dir / "cases" / f"{ok}.json").read_text())
    events = EventAccumulator(str(tmp_path / run_dir.name / ok))
    events.Reload()
    assert {"loss", "time/step_s"} <= set(events.Tags()["scalars"])
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(s["step"], pytest.approx(s["loss"], rel=1e-6)) for s in stored["steps"]]
    assert len(list((tmp_path / run_dir.name).iterdir())) == len(list((run_dir / "cases").glob("*.json")))
    assert not list(tmp_path.rglob(".*-*"))  # no staging directory left behind


def test_export_bad_input(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (["--format", "xls"], []):
        result = zbench("export", str(empty), *args, "--out", str(tmp_path / "out"))
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.heavy
def test_resume_runs_only_missing_cases(suite_run, tmp_path):
    _, tmp, run_dir = suite_run
    import shutil

    copy = tmp_path / "results"
    shutil.copytree(run_dir.parent, copy)
    victim = copy / run_dir.name / "cases" / "tiny-torch_zero-s1-w2-fp32-none.json"
    victim.unlink()
    result = zbench(
        "run",
        str(tmp / "suite.yaml"),
        "--results",
        str(copy),
        "--report",
        str(tmp_path / "rep"),
        "--resume",
        run_dir.name,
    )
    assert "already stored" in result.stderr
    # the run had finished, so its DDP reference's and noise twin's parameters were gone: both run again, then the case
    assert result.stderr.count("running on 2 cpu ranks") == 3
    assert "re-running tiny-ddp-s0-w2-fp32-none:" in result.stderr
    assert "re-running tiny-ddp-s0-w2-fp32-none-twin:" in result.stderr
    again = json.loads(victim.read_text())
    assert again["status"] == "ok" and again["equivalence"]["equivalent"] is True, again["equivalence"]
