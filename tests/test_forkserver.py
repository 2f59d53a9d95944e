"""Ranks forked from the fork server train exactly as ranks started as fresh interpreters, fail the same way, and
are used only where they can be (``zbench.launch.forkserver``).

The other suite tests run forked ranks (the default); here the same small suite also runs with
``ZBENCH_FORK_RANKS=0``, the way ranks started before, so both paths stay tested end to end (DDP and a planted
SIGKILL: every implementation trains forked in the other tests).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import zbench
from zbench.launch import forkserver
from zbench.launch.handoff import CaseFiles

FAULTY = "tests.plugins.faulty:FAULTY"
SUITE = f"""
name: fork-or-fresh
device: cpu
models: tiny
world_sizes: 2
steps: 6
warmup_steps: 1
paired_rounds: 0
noise_twin: false
timeout_s: 300
implementations:
  - ddp
  - {{name: "{FAULTY}", options: {{fault: sigkill}}}}
"""


def run_suite(tmp: Path, label: str, **env: str) -> dict[str, dict]:
    (tmp / "s.yaml").write_text(SUITE)
    result = zbench("run", str(tmp / "s.yaml"), "--results", str(tmp / label), "--report", str(tmp / "report"), env=env)
    assert result.returncode == 1, result.stderr  # the planted SIGKILL fails its case, and only it
    (run_dir,) = (tmp / label).iterdir()
    records = [json.loads(p.read_text()) for p in (run_dir / "cases").glob("*.json")]
    return {r["config"]["implementation"]: r for r in records}


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[dict[str, dict], dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("fork")
    return run_suite(tmp, "forked"), run_suite(tmp, "fresh", ZBENCH_FORK_RANKS="0")


def test_forked_ranks_train_bit_for_bit_as_fresh_ones(both):
    forked, fresh = both
    assert forked["ddp"]["status"] == fresh["ddp"]["status"] == "ok"
    assert [s["loss"] for s in forked["ddp"]["steps"]] == [s["loss"] for s in fresh["ddp"]["steps"]]
    assert forked["ddp"]["param_checksums"] == fresh["ddp"]["param_checksums"]


def test_a_killed_rank_is_named_on_both_paths(both):
    """The agent reports only the first forked rank it sees fail; the rank's own exit file names the killed one,
    ahead of its peer's error in the next collective."""
    for records in both:
        case = records[FAULTY]
        assert case["status"] == "error"
        assert case["error"] == "rank 1 killed by signal SIGKILL without a result"


def test_fork_only_where_the_ranks_need_nothing_the_server_lacks(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert forkserver.rank_env("cpu") == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    assert forkserver.rank_env("cuda") == {}
    monkeypatch.setattr(forkserver, "_server_env", {})  # as if started for GPU ranks
    assert forkserver.can_fork("cuda") and not forkserver.can_fork("cpu")
    with forkserver.fresh_interpreters():
        assert not forkserver.can_fork("cuda")
    monkeypatch.setenv(forkserver.FORK_RANKS_VAR, "0")
    assert not forkserver.can_fork("cuda")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own value is kept, and asks for nothing
    assert forkserver.rank_env("cpu") == {}


def test_exit_files_are_read_in_the_order_the_ranks_ended(tmp_path):
    files = CaseFiles(tmp_path)
    for rank, code, mtime in ((3, 3, 30), (1, -9, 10), (0, -15, 20)):
        files.exit_code(rank).write_text(str(code))
        os.utime(files.exit_code(rank), ns=(mtime, mtime))
    (tmp_path / "rank2.exit").write_text("")  # being written
    assert list(files.exit_codes().items()) == [(1, -9), (0, -15), (3, 3)]


def test_a_forked_rank_sees_the_harness_environment_of_now_with_the_agents_variables_over_it():
    """The fork server's environment dates from the harness's first case; a variable the harness set or dropped
    since reaches the rank as it would reach a fresh one, and the agent's per-rank variables win."""
    server = {"PATH": "/bin", "OLD": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    current = {**server, "RANK": "1", "MASTER_PORT": "29500"}  # as the agent's wrapper leaves the forked rank
    harness = {"PATH": "/bin", "NEW": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}  # OLD dropped, NEW set
    assert forkserver.rank_environment(current, harness, server) == {**harness, "RANK": "1", "MASTER_PORT": "29500"}
