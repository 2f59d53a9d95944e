"""A real headless browser for the report's tests: the system's Chromium (or Chrome) driven by Playwright.

Nothing here downloads a browser: Playwright's ``playwright install`` is never run; it launches the executable
found on this machine (``$ZBENCH_BROWSER``, a name on PATH or a path, else the first of ``BROWSER_NAMES`` on PATH),
and where there is none the tests skip, saying so (.ci/run installs the OS package where it can).

Every page opened records what a report page must never do: console errors, uncaught exceptions, requests that
leave the report's own files (aborted, so a test never touches the network), local files that failed to load,
and dialogs (dismissed). One browser per test module::

    @pytest.fixture(scope="module")
    def browser():
        with launch() as b:
            yield b

    def test_index(browser, report_dir):
        view = browser.open(report_dir / "index.html")
        wait_for_charts(view)
        view.assert_clean()
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser as PlaywrightBrowser
    from playwright.sync_api import BrowserContext, ConsoleMessage, Dialog, Page, Request, WebSocket

#: Looked for on PATH in this order when ``ZBENCH_BROWSER`` is not set.
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

#: Requests a report page may make. ``file:`` is the report directory itself; ``data:`` and ``blob:`` URLs hold
#: bytes the page already has (an inline image or font; the CSV a table's download button builds with
#: ``URL.createObjectURL``) and never leave the machine. Anything else (http, https, ws, ftp, ...) is recorded
#: and aborted.
LOCAL_SCHEMES = ("file:", "data:", "blob:")

#: ``--no-sandbox``: CI containers run as root, where Chromium refuses its sandbox, and the pages are our own files
#: (Playwright adds it by default too; named so the tests do not rest on that default). Nothing else: no
#: ``--allow-file-access-from-files`` or the like, so a page meets what a user's browser allows it.
LAUNCH_ARGS = ["--no-sandbox"]

NO_BROWSER = (
    "no Chromium or Chrome to drive: none of {names} is on PATH and ZBENCH_BROWSER is not set; install the "
    "system's Chromium (Debian: apt-get install chromium; .ci/run does where it can) or set ZBENCH_BROWSER to one"
)

#: The chart containers a report page draws into: the page's wrappers and plotly's own plot divs.
CHART_SELECTOR = ".chart, .plotly-graph-div, .js-plotly-plot"


class BrowserNotFound(RuntimeError):
    """``ZBENCH_BROWSER`` names something that is not an executable (a mistake, not a reason to skip)."""


def find_browser() -> str | None:
    """The browser's executable path: ``$ZBENCH_BROWSER`` (which must exist), else the first of ``BROWSER_NAMES``
    on PATH, else ``None``."""
    chosen = os.environ.get("ZBENCH_BROWSER", "").strip()
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise BrowserNotFound(f"ZBENCH_BROWSER={chosen!r} is not an executable (a name on PATH or a path)")
        return found
    for name in BROWSER_NAMES:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def is_local(url: str) -> bool:
    return url.startswith(LOCAL_SCHEMES)


def file_url(path: Path | str, fragment: str = "") -> str:
    """``path`` (made absolute) as a ``file://`` URL, with ``#fragment`` when given."""
    url = Path(path).resolve().as_uri()
    return f"{url}#{fragment}" if fragment else url


def url_path(url: str) -> Path:
    """The file a ``file://`` URL names (query and fragment dropped)."""
    parts = urlsplit(url)
    if parts.scheme != "file":
        raise ValueError(f"not a file:// URL: {url}")
    return Path(unquote(parts.path))


@dataclass
class PageView:
    """An open page and everything it did that a report page must not do (filled in as it happens)."""

    page: Page
    console_errors: list[str] = field(default_factory=list)
    """Console messages of type ``error`` (a script's ``console.error``, a resource that failed to load, ...)."""
    page_errors: list[str] = field(default_factory=list)
    """Uncaught exceptions and unhandled rejections."""
    outside_requests: list[str] = field(default_factory=list)
    """Every request (and web socket) whose URL is not ``file:``, ``data:`` or ``blob:``; each was aborted."""
    failed_requests: list[str] = field(default_factory=list)
    """Local requests that failed (a script, page or chart file missing beside the page)."""
    dialogs: list[str] = field(default_factory=list)
    """``alert``/``confirm``/``prompt``/``beforeunload`` dialogs, as ``"type: message"``; each was dismissed."""

    def problems(self) -> list[str]:
        return [
            *(f"console error: {m}" for m in self.console_errors),
            *(f"page error: {m}" for m in self.page_errors),
            *(f"request outside the report: {u}" for u in self.outside_requests),
            *(f"failed to load: {u}" for u in self.failed_requests),
            *(f"dialog: {m}" for m in self.dialogs),
        ]

    def assert_clean(self) -> None:
        """Fail listing every console error, page error, outside or failed request and dialog seen so far."""
        problems = self.problems()
        assert not problems, f"{self.page.url}:\n" + "\n".join(problems)

    def close(self) -> None:
        self.page.context.close()


class Browser:
    """One launched headless browser; ``open`` gives each page its own context (no shared storage or cache)."""

    def __init__(self, browser: PlaywrightBrowser, executable: str, *, timeout_s: float = 60.0) -> None:
        self.browser = browser
        self.executable = executable
        self.timeout_ms = timeout_s * 1000

    def new_view(self) -> PageView:
        """A blank page with every recorder attached (for a test that navigates itself)."""
        context = self.browser.new_context(viewport={"width": 1280, "height": 900})
        context.set_default_timeout(self.timeout_ms)
        page = context.new_page()
        view = PageView(page)
        _record(context, page, view)
        return view

    def open(
        self,
        path: Path | str,
        *,
        fragment: str = "",
        wait_until: Literal["commit", "domcontentloaded", "load", "networkidle"] = "load",
    ) -> PageView:
        """Open ``path`` as a ``file://`` URL in a fresh context and wait for its ``load`` event (``wait_until``:
        Playwright's ``"load"``, ``"domcontentloaded"`` or ``"networkidle"``)."""
        view = self.new_view()
        view.page.goto(file_url(path, fragment), wait_until=wait_until)
        return view


def _record(context: BrowserContext, page: Page, view: PageView) -> None:
    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            where = message.location
            view.console_errors.append(f"{message.text} ({where.get('url')}:{where.get('lineNumber')})")

    def on_request(request: Request) -> None:
        if not is_local(request.url):
            view.outside_requests.append(request.url)

    def on_failed(request: Request) -> None:
        if is_local(request.url):
            view.failed_requests.append(f"{request.url} ({request.failure})")

    def on_websocket(socket: WebSocket) -> None:
        view.outside_requests.append(socket.url)

    def on_dialog(dialog: Dialog) -> None:
        view.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    # Aborted before it leaves: a report that grew a CDN link fails here without fetching anything.
    context.route(lambda url: not is_local(url), lambda route: route.abort())
    context.on("request", on_request)  # the context's: popups and workers included
    context.on("requestfailed", on_failed)
    context.on("console", on_console)
    page.on("pageerror", lambda error: view.page_errors.append(f"{error.name}: {error.message}"))
    page.on("websocket", on_websocket)
    page.on("dialog", on_dialog)


@contextmanager
def launch(*, timeout_s: float = 60.0) -> Iterator[Browser]:
    """Launch the system's browser headless for the ``with`` block; ``pytest.skip`` (saying why) where there is
    none. Meant for a module-scoped fixture: launching costs about a second."""
    executable = find_browser()
    if executable is None:
        pytest.skip(NO_BROWSER.format(names=", ".join(BROWSER_NAMES)))
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        message = "playwright is not installed (it is in the test extra: pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=LAUNCH_ARGS, timeout=timeout_s * 1000
        )
        try:
            yield Browser(browser, executable, timeout_s=timeout_s)
        finally:
            browser.close()


#: Each innermost chart container: its id, its main SVG's size, its traces and how many data marks it drew.
_CHART_BOXES_JS = """(selector) => {
  const all = Array.from(document.querySelectorAll(selector));
  const innermost = all.filter((el) => !all.some((other) => other !== el && el.contains(other)));
  return innermost.map((el, index) => {
    const svg = el.querySelector("svg.main-svg");
    const box = svg ? svg.getBoundingClientRect() : { width: 0, height: 0 };
    // Data marks of any trace type (bars, points, lines, boxes, pie slices, heatmap images) with some extent.
    const marks = Array.from(el.querySelectorAll(".trace path, .trace image, .slice path")).filter((m) => {
      const b = m.getBBox();
      return b.width > 0 || b.height > 0;
    });
    return {
      index,
      id: el.id || "",
      title: (el.querySelector(".gtitle") || {}).textContent || "",
      width: box.width,
      height: box.height,
      traces: Array.isArray(el.data) ? el.data.length : el.querySelectorAll(".trace").length,
      marks: marks.length,
    };
  });
}"""


def chart_boxes(view: PageView) -> list[dict[str, Any]]:
    """Every chart on the page (the innermost element matching ``CHART_SELECTOR``): ``index``, ``id``, ``title``,
    ``width`` and ``height`` of its plotly SVG (0 when none was drawn), ``traces`` and drawn ``marks``."""
    return view.page.evaluate(_CHART_BOXES_JS, CHART_SELECTOR)


def wait_for_charts(view: PageView, *, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """Scroll to each chart in turn, as a reader would (a report page draws a chart when it comes near the
    screen), and wait until every chart has drawn an SVG of non-zero size (or ``timeout_s`` passed; then the
    returned ``chart_boxes`` show which did not); return ``chart_boxes``."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    one_drawn = (
        "(i) => { const svg = document.querySelectorAll('.chart')[i].querySelector('svg.main-svg');"
        " return !!svg && svg.getBoundingClientRect().width > 0 }"
    )
    drawn = f"(selector) => ({_CHART_BOXES_JS})(selector).every((c) => c.width > 0 && c.height > 0)"
    try:
        for i in range(view.page.locator(".chart").count()):
            view.page.locator(".chart").nth(i).scroll_into_view_if_needed()
            view.page.wait_for_function(one_drawn, arg=i, timeout=timeout_s * 1000)
        view.page.wait_for_function(drawn, arg=CHART_SELECTOR, timeout=timeout_s * 1000)
    except PlaywrightTimeout:
        pass
    return chart_boxes(view)


def follow(view: PageView, selector: str) -> str:
    """Click the element ``selector`` matches (a link), wait for the page it leads to to load, return its URL.
    The recorders stay attached: ``view.assert_clean()`` then covers both pages."""
    with view.page.expect_navigation(wait_until="load"):
        view.page.click(selector)
    return view.page.url


def local_links(view: PageView) -> list[str]:
    """The resolved ``href`` of every ``<a>`` on the page whose target is a ``file:`` URL, in page order."""
    hrefs: list[str] = view.page.eval_on_selector_all("a[href]", "(links) => links.map((a) => a.href)")
    return [h for h in hrefs if h.startswith("file:")]


def text_nodes_containing(view: PageView, text: str) -> list[str]:
    """The tag names of the elements with a text node holding ``text`` (outside ``<script>`` and ``<style>``):
    where the page shows ``text`` as text."""
    return view.page.evaluate(
        """(text) => {
          const out = [];
          const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
          for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            const parent = node.parentElement;
            if (parent && !["SCRIPT", "STYLE"].includes(parent.tagName) && node.data.includes(text)) {
              out.push(parent.tagName.toLowerCase());
            }
          }
          return out;
        }""",
        text,
    )
