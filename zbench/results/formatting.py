"""How figures and verdicts read: one place for the units and words the console, the gate and the report share."""

from __future__ import annotations

from zbench.results.record import CaseRecord


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_money(amount: float | None) -> str:
    """A cost in the price's own currency (none is assumed): 4 significant figures, small amounts included."""
    return "-" if amount is None else f"{amount:.4g}"


def fmt_rate(r: float | None) -> str:
    return "-" if not r else f"{r:.0f}"


def verdict_text(record: CaseRecord) -> str:
    eq = record.equivalence
    if not record.ok or eq is None:
        return "-"
    if eq.reference_case == record.case_id:
        return "reference"
    if record.config.noise_twin:
        return "noise twin (sets the bounds)"
    margins = [c.margin for c in eq.checks if c.margin is not None and not c.probe]
    probed = [c.margin for c in eq.checks if c.margin is not None and c.probe]
    if eq.equivalent:
        worst = f"worst check at {max(margins):.0%} of its bound" if margins else ""
        probe = f"fp32 probe's worst at {max(probed):.0%}" if probed else ""
        unjudged = next((f"fp32 probe {c.detail}" for c in eq.checks if c.probe and c.passed is None), "")
        within = "; ".join(filter(None, [worst, probe, unjudged]))
        return f"equivalent ({within})" if within else "equivalent"
    failed = f" ({', '.join(eq.failed_checks)})" if eq.failed_checks else ""
    return f"NOT EQUIVALENT{failed}: {eq.reason or ''}"


def status_text(record: CaseRecord) -> str:
    if record.status == "skipped":
        return f"skipped: {record.skip_reason}"
    if not record.ok:
        return f"{record.status}: {record.error or ''}"
    return "ok"
