"""Screenshots of a rendered report for the docs: the front page and one case page (system Chromium, Playwright).

    python tests/tools/report_screenshots.py REPORT_DIR CASE_ID docs/images

Every chart is scrolled into view first (the pages draw a chart when it comes near the screen); the picture is
the top 2,200 pixels of each page.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from playwright.sync_api import sync_playwright

from tests.browser import (
    PageView,
    find_browser,
    wait_for_charts,
)


def shoot(report: Path, case_id: str, out: Path) -> None:
    executable = find_browser()
    if executable is None:
        raise SystemExit("no Chromium or Chrome found (apt-get install chromium, or set ZBENCH_BROWSER)")
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        for page_file, name in ((report / "index.html", "report-front.png"),
                                (report / "cases" / f"{case_id}.html", "report-case.png")):  # fmt: skip
            page = browser.new_page(viewport={"width": 1400, "height": 2200})
            page.goto(page_file.resolve().as_uri(), wait_until="load")
            wait_for_charts(PageView(page))
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(out / name))  # the top of the page: what a reader sees first
            page.close()
            print(out / name)
        browser.close()


if __name__ == "__main__":
    shoot(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
