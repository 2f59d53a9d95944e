"""tools/gpu-check.sh, the check a GPU box runs: what it selects, what it bundles and how it says no, here on CPU
(its GPU steps run on a lent GPU; docs/gpu-check.md has what they found)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, child_env

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
assert spec and spec.loader
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses resolve their module's names through sys.modules
spec.loader.exec_module(gpu_check)


def summary(tmp_path: Path, statuses: dict[str, str], figures: dict[str, dict] | None = None) -> Path:
    steps = [{"name": n, "status": s, "figures": (figures or {}).get(n, {})} for n, s in statuses.items()]
    (tmp_path / "summary.json").write_text(json.dumps({"steps": steps}))
    return tmp_path / "summary.json"


def test_rerun_runs_the_steps_that_did_not_pass_with_the_cases_they_left_out(tmp_path):
    left_out = {"suite-1.3b": {"not_run": ["gpt-1.3b-fsdp1-s3-w1-bf16-none"], "ddp-s0": {"status": "ok"}}}
    statuses = {"env": "pass", "tests": "fail", "suite-1.3b": "timeout", "profile": "skipped", "trace": "pass"}
    chosen, previous = gpu_check.steps_to_run(None, summary(tmp_path, statuses, left_out))
    assert chosen == {"tests", "suite-1.3b", "profile"}
    assert previous["suite-1.3b"]["not_run"] == ["gpt-1.3b-fsdp1-s3-w1-bf16-none"]
    assert gpu_check.steps_to_run("env,trace", None) == ({"env", "trace"}, {})
    assert gpu_check.steps_to_run(None, None)[0] == {s.name for s in gpu_check.STEPS}


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--steps", "env,nope"], "unknown step(s) nope"), (["--rerun", "missing.json"], "not a summary.json")],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    r = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--out", str(tmp_path / "out"), *args],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_bundles_leave_out_parameters_and_whatever_would_pass_the_limit(tmp_path, monkeypatch):
    """A machine hands back files of at most 16 MiB: the first H200 run lost every record to a 5 GB parameter file
    of gpt-1.3b's DDP reference in the results bundle."""
    monkeypatch.setattr(gpu_check, "BUNDLE_LIMIT", 2 * 1024**2)
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "env.log").write_text("env\n")
    cases = work / "results-suite" / "run1" / "cases"
    cases.mkdir(parents=True)
    (cases / "gpt-ddp.json").write_text(json.dumps({"status": "ok"}))
    (work / "results-suite" / "run1" / "params").mkdir()
    (work / "results-suite" / "run1" / "params" / "ref.pt").write_bytes(b"\0" * 1000)
    (work / "nvme").mkdir()
    (work / "nvme" / "swap.bin").write_bytes(b"\0" * 1000)
    (work / "trace.json").write_bytes(os.urandom(3 * 1024**2))  # incompressible, past the limit
    out.mkdir()
    left_out = gpu_check.bundle(work, out)
    assert left_out == ["trace.json (3.1 MB)"]
    with tarfile.open(out / "results.tar.gz") as tar:
        assert tar.getnames() == ["results-suite/run1/cases/gpt-ddp.json"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert tar.getnames() == ["logs/env.log"]


@pytest.mark.heavy
def test_dry_run_lists_the_cases_and_skips_the_gpu_steps(tmp_path):
    """What a machine without a GPU can run of the check: the environment, the GPU tests' clean skips and the suites'
    case lists; a rerun lists only the cases an earlier run left out (and their references)."""
    out = tmp_path / "out"
    case = "gpt-125m-zero3-s3-w1-bf16-nvme"
    earlier = summary(
        tmp_path, {"env": "pass", "tests": "fail", "suite-125m": "timeout"}, {"suite-125m": {"not_run": [case]}}
    )
    r = subprocess.run(
        ["bash", "tools/gpu-check.sh", "--out", str(out), "--dry-run", "--rerun", str(earlier)],
        cwd=ROOT, env=child_env(ZBENCH_WHEELS=str(tmp_path / "no-wheels")), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert set(steps) == {"tests", "suite-125m"}
    assert steps["tests"]["status"] == "skipped" and steps["tests"]["figures"]["skipped"] > 0
    assert steps["suite-125m"]["status"] == "skipped"
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "results.tar.gz", "summary.json", "summary.txt"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        listing = tar.extractfile("logs/suite-125m.log").read().decode()  # type: ignore[union-attr]
    assert case in listing and "gpt-125m-zero3-s3-w1-bf16-optimizer " not in listing


def test_trace_step_holds_each_traced_peak_against_the_same_cases_allocator_peak(tmp_path):
    """The comparison the GPU's figures come from, on records as the runner writes them (the trace's own run is the
    dry run's to prove): a traced row meets the case of the same implementation, stage and offload, and a row the
    tracer could not trace fails the step by name."""
    gib = 1024**3
    rows = [
        {"name": "ddp (stage 0)", "implementation": "ddp", "stage": 0, "offload": "none",
         "trace": {"error": None, "peak": {"device": {"bytes": 10 * gib}}}},
        {"name": "zero3 (stage 3)", "implementation": "zero3", "stage": 3, "offload": "none",
         "trace": {"error": None, "peak": {"device": {"bytes": 6 * gib}}}},
    ]  # fmt: skip
    (tmp_path / "trace-1.3b.json").write_text(json.dumps({"rows": rows}))
    measured = [
        {"case_id": "gpt-1.3b-ddp-s0-w1-bf16-none", "status": "ok", "equivalence": {"equivalent": True},
         "config": {"implementation": "ddp", "stage": 0, "offload": "none"},
         "memory": {"kind": "cuda_allocated", "peak_bytes": 8 * gib}},
        {"case_id": "gpt-1.3b-zero3-s3-w1-bf16-optimizer", "status": "ok", "equivalence": {"equivalent": True},
         "config": {"implementation": "zero3", "stage": 3, "offload": "optimizer"},
         "memory": {"kind": "cuda_allocated", "peak_bytes": 1 * gib}},  # another setup: not compared
    ]  # fmt: skip
    (tmp_path / "logs").mkdir()
    ctx = gpu_check.Context(tmp_path, dry_run=False, deadline=float("inf"))
    ctx.shared = {"trace_proc": subprocess.Popen(["true"]), "suite-1.3b": measured}
    outcome = gpu_check.step_trace(ctx)
    assert outcome.status == "pass", outcome.text
    assert outcome.figures["ddp-s0"] == {"traced_gib": 10.0, "allocator_gib": 8.0, "error": 0.25}
    assert outcome.figures["zero3-s3"]["allocator_gib"] is None
    assert "worst ddp-s0 +25.0%" in outcome.text

    # a rerun of the trace alone: the peaks come from the earlier run's figures of suite-1.3b
    ctx.previous = {"suite-1.3b": {"ddp-s0": gpu_check.case_figures(measured[0]), "not_run": []}}
    ctx.shared = {"trace_proc": subprocess.Popen(["true"])}
    assert gpu_check.step_trace(ctx).figures["ddp-s0"]["error"] == 0.25

    rows[1]["trace"] = {"error": "RuntimeError: no", "peak": None}
    (tmp_path / "trace-1.3b.json").write_text(json.dumps({"rows": rows}))
    ctx.shared["trace_proc"] = subprocess.Popen(["true"])
    outcome = gpu_check.step_trace(ctx)
    assert outcome.status == "fail" and "1 not: zero3 (stage 3)" in outcome.text
