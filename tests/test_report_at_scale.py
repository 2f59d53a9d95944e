"""The report of a 500-case run with a baseline run before it, in a real headless browser (tests/browser.py).

The run is synthetic (tests/report_data.py): 5 models x 5 world sizes x 2 precisions x 10 setups, three cases
planted slower or fatter than in the baseline run. What a user does with it is checked for real: the matrix
marks one fastest and one leanest setup per row and colours exactly the planted cases, the changes list names
them, sorting orders the 500 rows, filtering keeps exactly the matching ones, the CSV holds the rows shown,
every link on a case page leads to a page that loads. The render time, the front page's load time and one
sort's time are measured and reported (printed with the results), not asserted: this machine's speed drifts.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import Browser, PageView, follow, launch, local_links, url_path, wait_for_charts
from tests.conftest import zbench
from tests.report_data import configurations, stored_run

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

CASES = 500
SLOWER = frozenset({3, 17})
FATTER = frozenset({5})


@pytest.fixture(scope="module")
def figures() -> dict[str, float]:
    return {}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, figures: dict[str, float]) -> Path:
    root = tmp_path_factory.mktemp("scale")
    stored_run(root / "results", "base", CASES, started_at="2026-11-24T00:00:00")
    stored_run(root / "results", "new", CASES, started_at="2026-11-25T00:00:00", slower=SLOWER, fatter=FATTER, seed=1)
    started = time.perf_counter()
    result = zbench("report", str(root / "results"), "--report", str(root / "report"))
    figures["render_s (CLI, torch import included)"] = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    return root / "report"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch(timeout_s=120) as b:
        yield b


@pytest.fixture(scope="module")
def index(browser: Browser, report: Path, figures: dict[str, float]) -> Iterator[PageView]:
    view = browser.open(report / "index.html")
    figures["front page load_s (navigation to load event)"] = view.page.evaluate(
        "() => { const n = performance.getEntriesByType('navigation')[0]; return (n.loadEventEnd - n.startTime) / 1e3 }"
    )
    wait_for_charts(view, timeout_s=60)
    yield view
    view.close()


@pytest.fixture(scope="module", autouse=True)
def report_figures(figures: dict[str, float]) -> Iterator[None]:
    yield
    if figures:
        lines = [f"{name}: {value:.3f}" for name, value in figures.items()]
        print(f"\n[{CASES}-case report] " + "; ".join(lines))


def planted_ids() -> set[str]:
    from tests.conftest import make_case

    configs = configurations(CASES)
    return {make_case(**configs[i]).case_id for i in SLOWER | FATTER}


def visible_rows(view: PageView) -> list[list[str]]:
    return view.page.evaluate(
        """() => Array.from(document.querySelectorAll('#cases-table tbody tr'))
              .filter((r) => !r.hidden).map((r) => Array.from(r.cells, (c) => c.dataset.v ?? c.textContent.trim()))"""
    )


def test_the_front_page_loads_clean_with_every_chart(index: PageView) -> None:
    index.assert_clean()
    assert index.page.locator("#cases-table tbody tr").count() == CASES


def test_the_matrix_marks_one_fastest_and_one_leanest_per_row(index: PageView) -> None:
    rows = index.page.locator("#matrix-table tbody tr")
    assert rows.count() == 50  # 5 models x 5 world sizes x 2 precisions
    for i in range(rows.count()):
        row = rows.nth(i)
        assert row.locator(".badge.fastest").count() == 1 and row.locator(".badge.leanest").count() == 1


def test_exactly_the_planted_cases_are_coloured_and_listed(index: PageView) -> None:
    coloured = index.page.eval_on_selector_all("#matrix-table div.regression a", "(links) => links.map((a) => a.title)")
    assert set(coloured) == planted_ids()
    listed = index.page.eval_on_selector_all(
        "#changes-table tbody tr.regression td:first-child a", "(a) => a.map((x) => x.textContent)"
    )
    assert set(listed) == planted_ids()


def test_sorting_orders_every_row_both_ways(browser: Browser, report: Path, figures: dict[str, float]) -> None:
    view = browser.open(report / "index.html")
    header = view.page.locator("#cases-table thead th", has_text="step time (median)")
    column = view.page.locator("#cases-table thead th").all_inner_texts().index("step time (median)")
    header.click()
    figures["sort of 500 rows_ms"] = float(view.page.eval_on_selector("#cases-table", "(t) => t.dataset.sortMs"))
    times = [float(r[column]) for r in visible_rows(view)]
    assert len(times) == CASES and times == sorted(times)
    header.click()
    times = [float(r[column]) for r in visible_rows(view)]
    assert times == sorted(times, reverse=True)
    view.assert_clean()
    view.close()


def test_filtering_keeps_exactly_the_matching_rows_and_the_csv_holds_them(browser: Browser, report: Path) -> None:
    view = browser.open(report / "index.html")
    view.page.fill("input[data-filter-for='cases-table']", "zero3 nvme bf16")
    expected = [c for c in configurations(CASES) if c["implementation"] == "zero3" and c["offload"] == "nvme"]
    expected = [c for c in expected if c["precision"] == "bf16"]
    shown = visible_rows(view)
    assert len(shown) == len(expected) == 25
    assert view.page.text_content("[data-count-for='cases-table']") == f"25 of {CASES} shown"
    table = list(
        csv.reader(io.StringIO(view.page.evaluate("zbenchReport.tableCsv(document.getElementById('cases-table'))")))
    )
    assert table[0][0] == "case" and len(table) == 1 + 25
    assert all("zero3" in row[0] and row[0].endswith("bf16-nvme") for row in table[1:])
    with view.page.expect_download() as download:  # the button hands the same rows over as a file
        view.page.click("button[data-csv-for='cases-table']")
    assert Path(download.value.path()).read_text() == view.page.evaluate(
        "zbenchReport.tableCsv(document.getElementById('cases-table'))"
    )
    view.page.fill("input[data-filter-for='cases-table']", "")
    assert len(visible_rows(view)) == CASES
    view.assert_clean()
    view.close()


def test_case_pages_link_both_ways_and_every_link_loads(browser: Browser, report: Path) -> None:
    view = browser.open(report / "index.html")
    planted = sorted(planted_ids())[0]
    url = follow(view, f"#cases-table a[href='cases/{planted}.html']")
    assert url_path(url) == report / "cases" / f"{planted}.html"
    wait_for_charts(view)
    assert view.page.locator(".regression").count() >= 1  # this case's change, coloured on its own page
    for link in local_links(view):
        assert url_path(link).is_file(), link
    follow(view, "#reference")
    assert "ddp" in view.page.title()
    follow(view, "#back")
    assert url_path(view.page.url) == report / "index.html"
    view.assert_clean()
    view.close()
