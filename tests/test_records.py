"""The typed records: JSON round trips, a stored schema-1 run still loads, and what cannot be read fails cleanly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import make_case, zbench
from zbench.errors import UsageError
from zbench.launch.handoff import CollectiveEntry, RankResult, WorkerTask
from zbench.results import store
from zbench.results.record import SCHEMA_VERSION, CaseRecord, NvmlSummary, PhaseTimes, RankMemory
from zbench.results.store import RunDir

FIXTURE = Path(__file__).parent / "fixtures" / "schema1"
"""A run written by zbench before the typed records (schema 1): tiny GPT, world 2, fp16, DDP and ZeRO-2 with and
without optimizer offload (ok, with engine metrics per step), FSDP skipped."""
RUN_ID = "20261123-202118-5b9c37"


def schema1_run(tmp_path: Path) -> RunDir:
    shutil.copytree(FIXTURE, tmp_path / "results")
    return RunDir(tmp_path / "results", RUN_ID)


def test_a_schema1_run_loads_as_typed_records(tmp_path):
    run = schema1_run(tmp_path)
    info = run.info()
    assert info.suite.name == "fixture-v1" and info.environment.cpu_count and info.suite.warmup_steps == 2
    records = {r.case_id: r for r in run.cases()}
    assert len(records) == 5
    zero2 = records["tiny-zero2-s2-w2-fp16-none"]
    assert zero2.ok and zero2.equivalent and zero2.config.capabilities is None
    assert zero2.steps[0].metrics["loss_scale"] == 65536.0 and zero2.steps[0].forward_s is not None
    assert zero2.model_state and zero2.model_state.by_location["device"].measured > 0
    assert zero2.comms and zero2.comms.by_op and zero2.memory and zero2.memory.per_rank
    skipped = records["tiny-fsdp-s3-w2-fp16-none"]
    assert skipped.status == "skipped" and "fp16 not supported" in (skipped.skip_reason or "")
    assert not skipped.failed and zero2.summary_row().equivalent is True


def test_a_schema1_run_reports_and_gates(tmp_path):
    run = schema1_run(tmp_path)
    r = zbench("report", str(run.path), "--report", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    assert "tiny-zero2-s2-w2-fp16-optimizer" in (tmp_path / "report" / "index.html").read_text()
    df = store.load_steps(tmp_path / "results")
    assert "loss_scale" in df.columns and len(df) == 3 * 6


def test_case_record_round_trips(tmp_path):
    record = next(r for r in schema1_run(tmp_path).cases() if r.ok)
    data = json.loads(json.dumps(record.to_json_dict()))
    assert data["schema_version"] == SCHEMA_VERSION and data["case_id"] == record.case_id
    assert CaseRecord.from_json_dict(data) == record


def test_worker_messages_round_trip():
    case = make_case(steps=2, warmup_steps=1, micro_batch=2, timeout_s=9.0, options={"x": [1, 2]})
    task = WorkerTask(case=case, swap_dir="/nvme/zbench-r-c")
    assert WorkerTask.model_validate_json(task.model_dump_json()) == task
    result = RankResult(
        rank=1,
        losses=[1.0, 0.9],
        step_times_s=[0.1, 0.1],
        metrics=[{}, {"loss_scale": 2.0}],
        comms=[[CollectiveEntry(op="all_reduce", dtype="float32", count=1, elements=4, bytes=16)], []],
        phases=[PhaseTimes(forward_s=0.01), PhaseTimes()],
        clock="perf_counter",
        bus_bandwidth_bytes_per_s=None,
        expected_comm_elements=8,
        memory=RankMemory(kind="rss", bytes=100),
        state_bytes={"parameters": {"device": 8}},
        nvml=NvmlSummary(available=False, reason="CPU run"),
        gpu_name=None,
        parameters=4,
        param_checksum="0123abcd",
    )
    assert RankResult.model_validate_json(result.model_dump_json()) == result


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "not a zbench result file"),
        (json.dumps({"schema_version": 99, "config": {}, "status": "ok"}), "newer than this zbench"),
        (json.dumps({"schema_version": 2, "status": "ok"}), "not a zbench result file"),
    ],
)
def test_an_unreadable_record_is_one_clear_error(tmp_path, content, why):
    run = schema1_run(tmp_path)
    (run.cases_dir / "zz-broken.json").write_text(content)
    with pytest.raises(UsageError, match=why):
        run.cases()
    r = zbench("report", str(run.path), "--report", str(tmp_path / "report"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "zz-broken.json" in r.stderr
