"""The report page from a stored run: cost per step and per million tokens at a price per GPU-hour (the arithmetic
and the column), and the charting library shipped once beside the page instead of inlined into it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_case, zbench
from zbench.results.record import CaseRecord, Equivalence, MemorySummary, ModelState, StepSample, StepTimeSummary
from zbench.results.run_info import Environment, RunInfo, SuiteInfo
from zbench.results.store import RunDir
from zbench.values import CATEGORIES, LOCATIONS

#: 2 ranks x 4 sequences x 32 tokens = 256 tokens a step, 0.1 s a step.
CASE = make_case(world_size=2, micro_batch=4, seq_len=32, grad_accum=1)


def record(**case: object) -> CaseRecord:
    return CaseRecord(
        config=CASE.model_copy(update=case),
        status="ok",
        steps=[StepSample(step=i, loss=1.0, step_time_s=0.1, warmup=False) for i in range(5)],
        summary=StepTimeSummary(step_time_median_s=0.1, tokens_per_s=2560.0, tokens_per_s_per_rank=1280.0),
        memory=MemorySummary(kind="rss", peak_bytes=2**30),
        model_state=ModelState(
            measured={c: dict.fromkeys(LOCATIONS, 0) for c in CATEGORIES}, measured_total=2**20, expected_total=2**20
        ),
        equivalence=Equivalence(equivalent=True),
    )


def test_every_rank_is_paid_for_the_median_step():
    priced = record(price_per_gpu_hour=3.6)
    assert priced.cost_per_step() == pytest.approx(0.0002)  # 3.6 x 2 ranks x 0.1 s / 3600 s
    assert priced.cost_per_million_tokens() == pytest.approx(0.78125)  # 0.0002 / 256 tokens x 1e6
    assert priced.cost_per_step(7.2) == pytest.approx(2 * priced.cost_per_step())  # a price given later wins
    row = priced.summary_row()
    assert (row.cost_per_step, row.cost_per_million_tokens) == (
        priced.cost_per_step(),
        priced.cost_per_million_tokens(),
    )
    assert record().cost_per_step() is None and record().summary_row().cost_per_million_tokens is None


def stored_run(root: Path) -> None:
    run = RunDir(root, "r1")
    run.start(
        RunInfo(run_id="r1", suite=SuiteInfo(name="s", sha256="0" * 64), environment=Environment(host="h", cpu_count=2))
    )
    run.write_case(record())


@pytest.mark.heavy
def test_the_report_shows_cost_only_with_a_price(tmp_path):
    stored_run(tmp_path / "results")
    plain = zbench("report", str(tmp_path / "results"), "--report", str(tmp_path / "plain"))
    priced = zbench(
        "report", str(tmp_path / "results"), "--report", str(tmp_path / "priced"), "--price-per-gpu-hour", "3.6"
    )
    assert plain.returncode == 0 and priced.returncode == 0, plain.stderr + priced.stderr
    assert "per million tokens" not in (tmp_path / "plain" / "index.html").read_text()
    assert "<td>0.0002 / 0.7813</td>" in (tmp_path / "priced" / "index.html").read_text()
    bad = zbench("report", str(tmp_path / "results"), "--price-per-gpu-hour", "-1")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_the_chart_library_is_a_file_beside_the_page_written_once(tmp_path):
    stored_run(tmp_path / "results")
    first = zbench("report", str(tmp_path / "results"), "--report", str(tmp_path / "rep"))
    assert first.returncode == 0, first.stderr
    (library,) = (tmp_path / "rep").glob("plotly-*.min.js")
    page = (tmp_path / "rep" / "index.html").read_text()
    assert f'<script src="{library.name}"></script>' in page and 'class="chart-spec"' in page
    assert "Plotly.newPlot" in (tmp_path / "rep" / "zbench-report.js").read_text()  # draws the specs
    assert len(page) < 200_000 < library.stat().st_size  # the page holds the charts, not the 4.6 MB library
    written = library.stat().st_mtime_ns
    again = zbench("report", str(tmp_path / "results"), "--report", str(tmp_path / "rep"))
    assert again.returncode == 0 and library.stat().st_mtime_ns == written  # this version is there already


def test_the_matrix_marks_the_fastest_and_leanest_that_train_like_ddp_by_paired_ratio():
    """Planted: a faster setup that diverged, one that ran out of memory, and one whose absolute step time looks
    best only because the machine sped up while it ran (its paired ratio says it is slower than DDP)."""
    from zbench.report.matrix import build

    def setup(implementation: str, stage: int, *, step_s: float, ratio: float, mib: int, **changes: object):
        r = record(implementation=implementation, stage=stage)
        return r.model_copy(
            update={
                "summary": r.summary.model_copy(update={"step_time_median_s": step_s}),
                "ratio_to_ddp": ratio,
                "memory": MemorySummary(kind="rss", peak_bytes=mib * 2**20),
                **changes,
            }
        )

    ddp = setup("ddp", 0, step_s=0.10, ratio=1.0, mib=900)
    drifted = setup("zero1", 1, step_s=0.05, ratio=1.3, mib=800)  # measured while the machine ran fast
    quick = setup("zero2", 2, step_s=0.09, ratio=0.95, mib=700)
    diverged = setup("zero3", 3, step_s=0.01, ratio=0.5, mib=100, equivalence=Equivalence(equivalent=False))
    oom = setup("torch_zero", 1, step_s=0.01, ratio=0.5, mib=50, status="oom")
    (row,) = build([ddp, drifted, quick, diverged, oom]).rows
    assert (row.fastest, row.leanest) == (quick.case_id, quick.case_id)
    assert len(row.cells) == 5
    unpaired = [r.model_copy(update={"ratio_to_ddp": None}) for r in (ddp, drifted, quick)]
    assert build(unpaired).rows[0].fastest == drifted.case_id  # no ratios: the step time is all there is
