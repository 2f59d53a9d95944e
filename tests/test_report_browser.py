"""The report in a real headless browser (the system's Chromium, tests/browser.py): rendered by the CLI from a
stored run, opened from file:// it needs nothing but its own files, raises no error, draws every chart, and shows a
name holding markup as text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import (
    Browser,
    PageView,
    chart_boxes,
    follow,
    launch,
    local_links,
    text_nodes_containing,
    url_path,
    wait_for_charts,
)
from tests.conftest import make_case, zbench
from zbench.results.record import CaseRecord, Equivalence, MemorySummary, ModelState, StepSample, StepTimeSummary
from zbench.results.run_info import Environment, RunInfo, SuiteInfo
from zbench.results.store import RunDir
from zbench.values import CATEGORIES, LOCATIONS

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

#: Shown on the page as the implementation's name: it must stay text, never run.
SCRIPT = "<script>alert(1)</script>"

#: (implementation, stage, median step time in s, peak memory in MiB): DDP, the reference, first.
CASES = [
    ("ddp", 0, 0.100, 900),
    ("torch_zero", 1, 0.110, 700),
    ("torch_zero", 3, 0.140, 450),
    (SCRIPT, 2, 0.120, 600),
]


def record(implementation: str, stage: int, step_s: float, peak_mib: int, reference: str) -> CaseRecord:
    config = make_case(implementation=implementation, stage=stage)
    losses = [2.0 - 0.1 * i + 0.001 * stage for i in range(8)]
    return CaseRecord(
        config=config,
        status="ok",
        steps=[
            StepSample(step=i, loss=loss, step_time_s=step_s * (1 + 0.02 * (i % 3)), warmup=i == 0)
            for i, loss in enumerate(losses)
        ],
        summary=StepTimeSummary(
            step_time_median_s=step_s,
            step_time_iqr_s=0.004,
            step_time_q1_s=step_s - 0.002,
            step_time_q3_s=step_s + 0.002,
            tokens_per_s=256 / step_s,
            tokens_per_s_per_rank=128 / step_s,
            final_loss=losses[-1],
        ),
        memory=MemorySummary(kind="rss", peak_bytes=peak_mib * 2**20),
        model_state=ModelState(
            measured={c: dict.fromkeys(LOCATIONS, 0) for c in CATEGORIES},
            measured_total=2**20 // (stage + 1),
            expected_total=2**20 // (stage + 1),
        ),
        equivalence=Equivalence(equivalent=True, reference_case=reference),
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch() as b:
        yield b


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report directory the CLI rendered from a stored run of ``CASES``."""
    root = tmp_path_factory.mktemp("browser")
    run = RunDir(root / "results", "r1")
    run.start(
        RunInfo(run_id="r1", suite=SuiteInfo(name="s", sha256="0" * 64), environment=Environment(host="h", cpu_count=2))
    )
    reference = make_case(implementation="ddp", stage=0).case_id
    for case in CASES:
        run.write_case(record(*case, reference=reference))
    result = zbench("report", str(root / "results"), "--report", str(root / "report"))
    assert result.returncode == 0, result.stderr
    return root / "report"


@pytest.fixture(scope="module")
def index(browser: Browser, report: Path) -> Iterator[PageView]:
    """The report's index page, loaded, its charts drawn (read-only: tests that click open their own)."""
    view = browser.open(report / "index.html")
    wait_for_charts(view)
    yield view
    view.close()


def test_the_page_loads_from_file_with_no_error_and_no_other_request(index: PageView) -> None:
    assert index.page.url.startswith("file://") and index.page.url.endswith("/index.html")
    assert index.page.title().startswith("zbench report: s")
    index.assert_clean()


def test_every_chart_draws_something(index: PageView) -> None:
    charts = chart_boxes(index)
    assert len(charts) >= 4, charts  # step time, memory, model state, loss at least
    empty = [c for c in charts if not (c["width"] > 0 and c["height"] > 0 and c["traces"] > 0 and c["marks"] > 0)]
    assert not empty, empty


def test_a_name_holding_a_script_shows_as_text(index: PageView) -> None:
    assert text_nodes_containing(index, SCRIPT), f"{SCRIPT} is not shown as text anywhere"
    ran = index.page.evaluate("() => Array.from(document.scripts).filter((s) => s.text.trim() === 'alert(1)').length")
    assert ran == 0  # no <script> element made of it
    assert index.dialogs == []  # and no alert fired
    index.assert_clean()


def test_every_case_page_loads_clean_draws_its_charts_and_its_links_lead_somewhere(
    browser: Browser, report: Path
) -> None:
    pages = sorted((report / "cases").glob("*.html"))
    assert len(pages) == len(CASES)
    for page in pages:
        view = browser.open(page)
        charts = wait_for_charts(view)
        assert charts and all(c["width"] > 0 and c["marks"] > 0 for c in charts), (page.name, charts)
        for link in local_links(view):
            assert url_path(link).is_file(), (page.name, link)
        view.assert_clean()
        view.close()


def test_the_index_links_every_case_page_and_a_case_page_links_back(browser: Browser, report: Path) -> None:
    view = browser.open(report / "index.html")
    assert set((report / "cases").glob("*.html")) <= {url_path(link) for link in local_links(view)}
    zero = make_case(implementation="torch_zero", stage=3).case_id
    follow(view, f"#cases-table a[href='cases/{zero}.html']")
    assert url_path(view.page.url) == report / "cases" / f"{zero}.html"
    follow(view, "#reference")  # the DDP case it is compared with
    assert url_path(view.page.url) == report / "cases" / f"{make_case(implementation='ddp', stage=0).case_id}.html"
    follow(view, "#back")
    assert url_path(view.page.url) == report / "index.html"
    view.assert_clean()
    view.close()


def test_a_name_holding_a_script_shows_as_text_on_its_case_page(browser: Browser, report: Path) -> None:
    view = browser.open(report / "cases" / f"{make_case(implementation=SCRIPT, stage=2).case_id}.html")
    assert text_nodes_containing(view, SCRIPT)
    assert view.dialogs == []
    view.assert_clean()
    view.close()
