"""``zbench ab``: the base and head of a pull request measured in one job, interleaved, gated on the difference.

Why: a baseline from last night's run was measured on a machine in another
state; a pull request's question is "is head slower than base *here, now*".
Both checkouts run the same suite on the same runner in alternating rounds
(base, head, head, base, ...), so slow changes of the machine hit both sides
alike; within each run every case's step is also paired with a DDP copy's
(``zbench.rank.paired``). Each side's rounds are pooled per case and judged
with ``zbench.verdicts.regress`` exactly as ``zbench check`` judges two runs.

The base side's ranks import ``zbench`` (harness and implementations) from
the base checkout (``PYTHONPATH``); the suite, the launcher and the verdict are
the head's. A base too old to record paired rounds is judged on absolute step
times, and the verdict says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zbench.errors import UsageError
from zbench.launch.forkserver import environment, fresh_interpreters
from zbench.results.record import CaseRecord, PairedTiming, StepSample
from zbench.results.store import RunDir
from zbench.run.console import Progress
from zbench.run.environment import git_sha
from zbench.run.runner import run_suite
from zbench.suite.preflight import Suite
from zbench.verdicts.regress import CheckResult, Thresholds, case_findings

SIDES = ("base", "head")


def side_order(round_index: int) -> tuple[str, str]:
    """base first in even rounds, head first in odd ones: neither side always runs on a warmer machine."""
    return SIDES if round_index % 2 == 0 else SIDES[::-1]


@contextmanager
def code_from(checkout: Path | None) -> Iterator[None]:
    """Ranks launched inside import ``zbench`` from ``checkout`` (``None``: from this installation).

    Note: another checkout's ranks start as fresh interpreters; the fork server has imported this installation's.
    """
    if checkout is None:
        yield
        return
    path = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p)
    with environment({"PYTHONPATH": path}), fresh_interpreters():
        yield


def check_base_checkout(base: Path) -> Path:
    if sys.version_info < (3, 11):
        raise UsageError("zbench ab needs Python 3.11 or newer (its ranks import the base with PYTHONSAFEPATH)")
    base = base.resolve()
    if not (base / "zbench" / "worker.py").is_file():
        raise UsageError(
            f"--base {base}: not a zbench checkout (no zbench/worker.py); e.g. git worktree add ../base BASE_SHA"
        )
    return base


def run_rounds(suite: Suite, *, base: Path, results: Path, rounds: int, progress: Progress) -> dict[str, list[RunDir]]:
    """Every round runs the whole suite once per side; a side's runs go under ``results/<side>/``."""
    runs: dict[str, list[RunDir]] = {side: [] for side in SIDES}
    for i in range(rounds):
        for side in side_order(i):
            progress.note(f"round {i + 1}/{rounds}: {side}")
            with code_from(base if side == "base" else None):
                runs[side].append(run_suite(suite, results_root=results / side, progress=progress).run)
    return runs


def pooled(records: list[CaseRecord]) -> CaseRecord:
    """One record holding every round's timed steps and paired rounds; a failed round stands for the case."""
    failed = next((r for r in records if r.failed), None)
    if failed is not None:
        return failed
    steps = [StepSample(step=i, loss=0.0, step_time_s=t, warmup=False) for i, t in enumerate(_timed(records))]
    paired = PairedTiming(
        case_s=[t for r in records if r.paired for t in r.paired.case_s],
        reference_s=[t for r in records if r.paired for t in r.paired.reference_s],
    )
    return records[-1].model_copy(update={"steps": steps, "paired": paired})


def _timed(records: list[CaseRecord]) -> list[float]:
    return [t for r in records for t in r.timed_step_times()]


def verdict(runs: dict[str, list[RunDir]], thresholds: Thresholds, *, base_sha: str | None) -> CheckResult:
    """Head's pooled cases against base's, as ``zbench check`` judges a candidate against a baseline."""
    by_side = {side: _records_by_case(runs[side]) for side in SIDES}
    result = CheckResult(candidate="head", baselines=["base"], thresholds=thresholds)
    result.environment_changes = {"code": (base_sha, git_sha())}
    for case_id, head_records in by_side["head"].items():
        base = pooled(by_side["base"][case_id]) if case_id in by_side["base"] else None
        if base is None:
            result.unmatched.append(f"{case_id} (not in the base's suite)")
        elif not base.ok:
            result.unmatched.append(f"{case_id} (base {base.status}: {base.error or 'no error recorded'})")
        else:
            result.compared += 1
        comparable = [base] if base is not None and base.ok else []
        result.findings += case_findings(comparable, pooled(head_records), thresholds)
    return result


def _records_by_case(runs: list[RunDir]) -> dict[str, list[CaseRecord]]:
    out: dict[str, list[CaseRecord]] = {}
    for run in runs:
        for record in run.cases():
            if record.status != "skipped":
                out.setdefault(record.case_id, []).append(record)
    return out


def run(
    suite: Suite, *, base: Path, results: Path, rounds: int, thresholds: Thresholds, progress: Progress
) -> CheckResult:
    """Measure both sides in ``rounds`` interleaved rounds and judge head against base."""
    base = check_base_checkout(base)
    runs = run_rounds(suite, base=base, results=results, rounds=rounds, progress=progress)
    return verdict(runs, thresholds, base_sha=git_sha(str(base)))
