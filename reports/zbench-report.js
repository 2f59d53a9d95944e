// zbench report pages: charts drawn from the JSON specs in the page, sortable and filterable tables, CSV of the
// rows shown. No network, no framework: a page opened from file:// needs only this file and plotly's beside it.
"use strict";

const zbenchReport = (() => {
  function draw(spec) {
    if (spec.dataset.drawn) return;
    spec.dataset.drawn = "1";
    const figure = JSON.parse(spec.textContent);
    Plotly.newPlot(spec.dataset.target, figure.data, figure.layout, { displaylogo: false, responsive: true });
  }

  // A chart is drawn when it comes near the screen: a 500-case page opens at once instead of drawing a dozen
  // charts of 500 traces first.
  function drawChartsWhenSeen() {
    const specs = new Map();
    for (const spec of document.querySelectorAll("script.chart-spec")) specs.set(spec.dataset.target, spec);
    const seen = new IntersectionObserver((entries) => {
      for (const entry of entries) {
        if (!entry.isIntersecting) continue;
        seen.unobserve(entry.target);
        draw(specs.get(entry.target.id));
      }
    }, { rootMargin: "400px" });
    for (const id of specs.keys()) seen.observe(document.getElementById(id));
    window.addEventListener("beforeprint", () => specs.forEach(draw));
  }

  // A cell sorts by its data-v (a number) when it has one, else by its text.
  function sortKey(cell) {
    if (!cell) return "";
    const v = cell.dataset.v;
    if (v !== undefined && v !== "") {
      const n = Number(v);
      return Number.isNaN(n) ? v.toLowerCase() : n;
    }
    return cell.textContent.trim().toLowerCase();
  }

  function compare(a, b) {
    const an = typeof a === "number", bn = typeof b === "number";
    if (an && bn) return a - b;
    if (an !== bn) return an ? -1 : 1; // numbers before text ("-", "failed")
    return a < b ? -1 : a > b ? 1 : 0;
  }

  function sortBy(table, column) {
    const started = performance.now();
    const header = table.tHead.rows[0].cells[column];
    const descending = header.getAttribute("aria-sort") === "ascending";
    for (const th of table.tHead.rows[0].cells) th.removeAttribute("aria-sort");
    header.setAttribute("aria-sort", descending ? "descending" : "ascending");
    const body = table.tBodies[0];
    const keyed = Array.from(body.rows, (row) => [sortKey(row.cells[column]), row]);
    keyed.sort((x, y) => (descending ? -compare(x[0], y[0]) : compare(x[0], y[0])));
    const fragment = document.createDocumentFragment();
    for (const [, row] of keyed) fragment.appendChild(row);
    body.appendChild(fragment);
    table.dataset.sortMs = (performance.now() - started).toFixed(1);
  }

  // Every whitespace-separated term must appear somewhere in the row's text (case-insensitive).
  function filter(table, query) {
    const terms = query.toLowerCase().split(/\s+/).filter(Boolean);
    let shown = 0;
    for (const row of table.tBodies[0].rows) {
      if (row.dataset.text === undefined) row.dataset.text = row.textContent.toLowerCase();
      const match = terms.every((t) => row.dataset.text.includes(t));
      row.hidden = !match;
      if (match) shown += 1;
    }
    const count = document.querySelector(`[data-count-for="${table.id}"]`);
    if (count) count.textContent = `${shown} of ${table.tBodies[0].rows.length} shown`;
    return shown;
  }

  function csvField(text) {
    const t = text.replace(/\s+/g, " ").trim();
    return /[",\n]/.test(t) ? `"${t.replace(/"/g, '""')}"` : t;
  }

  // The header and the rows shown (after filtering, in the current order); a cell's data-csv wins over its text.
  function tableCsv(table) {
    const line = (row) => Array.from(row.cells, (c) => csvField(c.dataset.csv ?? c.textContent)).join(",");
    const rows = Array.from(table.tBodies[0].rows).filter((row) => !row.hidden);
    return [line(table.tHead.rows[0]), ...rows.map(line)].join("\n") + "\n";
  }

  function download(table) {
    const url = URL.createObjectURL(new Blob([tableCsv(table)], { type: "text/csv" }));
    const link = document.createElement("a");
    link.href = url;
    link.download = `${table.id}.csv`;
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 0);
  }

  function wireTables() {
    for (const table of document.querySelectorAll("table.sortable")) {
      Array.from(table.tHead.rows[0].cells).forEach((th, i) => {
        th.tabIndex = 0;
        th.title = "sort by this column";
        th.addEventListener("click", () => sortBy(table, i));
        th.addEventListener("keydown", (e) => { if (e.key === "Enter") sortBy(table, i); });
      });
    }
    for (const input of document.querySelectorAll("input[data-filter-for]")) {
      const table = document.getElementById(input.dataset.filterFor);
      input.addEventListener("input", () => filter(table, input.value));
    }
    for (const button of document.querySelectorAll("button[data-csv-for]")) {
      button.addEventListener("click", () => download(document.getElementById(button.dataset.csvFor)));
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    wireTables();
    drawChartsWhenSeen();
  });

  return { sortBy, filter, tableCsv };
})();
