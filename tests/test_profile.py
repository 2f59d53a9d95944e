"""``profile: {steps: [...]}``: one real run (CPU, gloo, world 2) writes a Chrome trace per rank and times the rest.

The profiled steps are set with ``--set``, the way a user profiles one run of a
suite without editing it.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import zbench
from zbench.measure.timing import summarize
from zbench.results.record import CaseRecord
from zbench.results.store import RunDir

SUITE = """
name: profiled
device: cpu
models: tiny
implementations: [ddp]
world_sizes: 2
steps: 6
warmup_steps: 1
noise_twin: false
paired_rounds: 0
"""
PROFILED = [2, 4]


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory) -> tuple[RunDir, CaseRecord]:
    """The one run every test here reads: its directory and its single case."""
    tmp = tmp_path_factory.mktemp("profile")
    (tmp / "suite.yaml").write_text(SUITE)
    result = zbench(
        "run", str(tmp / "suite.yaml"), "--results", str(tmp / "results"), "--report", str(tmp / "report"),
        "--set", f"profile.steps={PROFILED}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (path,) = (tmp / "results").iterdir()
    run = RunDir(path.parent, path.name)
    (record,) = run.cases()
    return run, record


def test_every_rank_writes_a_chrome_trace_the_record_lists(profiled_run):
    run, record = profiled_run
    assert record.profile_traces == [f"profiles/{record.case_id}/profile-rank{r}.json" for r in range(2)]
    for relative in record.profile_traces:
        trace = json.loads((run.path / relative).read_text())
        assert trace["traceEvents"], relative
        steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("zbench step")}
        assert steps == {f"zbench step {s}" for s in PROFILED}  # both sessions, merged into one file
    assert not list(run.path.rglob("*.tmp"))


def test_profiled_steps_are_flagged_and_left_out_of_the_statistics(profiled_run):
    _, record = profiled_run
    assert [s.step for s in record.steps if s.profiled] == PROFILED
    timed = [s.step_time_s for s in record.steps if not s.warmup and s.step not in PROFILED]
    assert record.timed_step_times() == timed and len(timed) == 3
    assert record.summary.step_time_median_s == summarize(timed)["median"]
    assert record.config.profile_steps == PROFILED


def test_a_follower_node_sends_its_ranks_traces_to_node_0(tmp_path):
    """Node 0 classifies the case from its own work directory, so a follower's traces must travel there too."""
    from zbench.launch.handoff import CaseFiles
    from zbench.launch.nodes import _worth_sending

    files = CaseFiles(tmp_path)
    for path in (files.profile(1), files.result(1), files.task, tmp_path / ".profile-rank1.json.step2.tmp"):
        path.write_text("{}")
    sent = [p.name for p in sorted(tmp_path.iterdir()) if _worth_sending(p, files)]
    assert sent == ["profile-rank1.json", "rank1.json"]
