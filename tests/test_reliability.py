"""Faults injected for real around the harness itself: SIGKILL mid-suite, concurrent runs, a full disk."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, child_env, is_rank_process, zbench, zbench_many

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

SUITE = """
device: cpu
models: tiny
world_sizes: 2
steps: {steps}
warmup_steps: 1
paired_rounds: 0
implementations: [{impls}]
"""


def write_suite(path: Path, steps: int = 6, impls: str = "ddp") -> Path:
    path.write_text(SUITE.format(steps=steps, impls=impls))
    return path


def stray_workers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if is_rank_process(p.pid)]


def wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_harness_killed_mid_suite_then_resume(tmp_path):
    suite = write_suite(tmp_path / "s.yaml", steps=30, impls="ddp, torch_zero, {name: fsdp, stages: [3]}")
    results = tmp_path / "results"
    env = child_env()
    harness = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zbench",
            "run",
            str(suite),
            "--results",
            str(results),
            "--report",
            str(tmp_path / "rep"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: len(list(results.glob("*/cases/*.json"))) >= 1, what="the first case file")
    wait_for(lambda: len(stray_workers()) >= 2, what="the second case's ranks")
    harness.send_signal(signal.SIGKILL)
    harness.wait()
    # a rank still importing torch asks for PDEATHSIG only when the import is done: on a loaded machine, seconds
    wait_for(lambda: not stray_workers(), timeout=60, what="ranks to die with the harness")

    run_dir = next(results.iterdir())
    files = list((run_dir / "cases").iterdir())
    stored = [f for f in files if not f.name.startswith(".")]
    assert len(stored) == 1
    for f in stored:
        assert json.loads(f.read_text())["status"] == "ok"  # whole, parseable

    resumed = zbench(
        "run", str(suite), "--results", str(results), "--report", str(tmp_path / "rep"), "--resume", run_dir.name
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("already stored") == 1
    assert resumed.stderr.count("running on 2 cpu ranks") == 3  # DDP's noise twin, torch_zero, fsdp
    final = {
        json.loads(f.read_text())["case_id"]: json.loads(f.read_text()) for f in (run_dir / "cases").glob("*.json")
    }
    assert len(final) == 4 and all(c["status"] == "ok" and c["equivalence"]["equivalent"] for c in final.values())
    assert not [p for p in (run_dir / "cases").iterdir() if p.name.startswith(".")]


def test_two_suites_at_once_into_one_results_directory(tmp_path):
    suite = write_suite(tmp_path / "s.yaml", steps=4)
    results = tmp_path / "results"
    a, b = zbench_many(
        [["run", str(suite), "--results", str(results), "--report", str(tmp_path / f"rep{i}")] for i in range(2)]
    )
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    runs = sorted(results.iterdir())
    assert len(runs) == 2
    for run in runs:
        case = json.loads(next((run / "cases").glob("*.json")).read_text())
        assert case["status"] == "ok"


def test_resume_of_a_run_being_written_is_refused(tmp_path):
    from zbench.results.run_info import RunInfo, SuiteInfo
    from zbench.results.store import RunDir, RunLock

    run = RunDir(tmp_path / "results", "r1")
    run.start(RunInfo(run_id="r1", suite=SuiteInfo(name="s")))
    suite = write_suite(tmp_path / "s.yaml", steps=4)
    with RunLock(run):
        r = zbench("run", str(suite), "--results", str(tmp_path / "results"), "--resume", "r1")
    assert r.returncode == 2
    assert "being written by another zbench process" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.fixture
def small_fs(tmp_path):
    """A real, tiny filesystem (tmpfs) to fill up; needs root, as on CI."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = "70m"
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_too_little_space_is_refused_before_any_work(small_fs, tmp_path):
    (small_fs / "filler").write_bytes(b"\0" * (20 * 2**20))
    r = zbench("run", str(write_suite(tmp_path / "s.yaml")), "--results", str(small_fs / "results"))
    assert r.returncode == 2
    assert "MiB free" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_disk_filling_up_mid_suite_stops_cleanly_and_keeps_what_was_stored(small_fs, tmp_path):
    suite = write_suite(tmp_path / "s.yaml", steps=20, impls="ddp, torch_zero")
    results = small_fs / "results"
    env = child_env()
    harness = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zbench",
            "run",
            str(suite),
            "--results",
            str(results),
            "--report",
            str(tmp_path / "rep"),
        ],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: len(list(results.glob("*/cases/*.json"))) >= 1, what="the first case file")
    with open(small_fs / "filler", "wb") as f:  # fill the disk to the last byte
        try:
            while True:
                f.write(b"\0" * 2**20)
        except OSError:
            pass
    _, stderr = harness.communicate(timeout=120)
    assert harness.returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert "No space left on device" in last and "--resume" in last and "Traceback" not in stderr
    stored = list(results.glob("*/cases/*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["status"] == "ok"
