"""``zbench gc``: prune old runs so a results directory that a nightly job fills does not fill the disk.

Keeps the newest ``keep`` runs of each suite (by start time); a run another
zbench process is writing (its lock is held) is never removed.
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

from zbench.results.store import RunDir, RunLock, RunLocked, runs_oldest_first


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prune(results: Path, *, keep: int, dry_run: bool = False) -> list[tuple[RunDir, int]]:
    """Remove all but the newest ``keep`` runs of each suite; return the runs removed (or to remove) and their sizes."""
    by_suite: dict[str, list[RunDir]] = defaultdict(list)
    for run in runs_oldest_first(results):
        by_suite[run.info().suite.name].append(run)
    removed = []
    for runs in by_suite.values():
        for run in runs[: max(0, len(runs) - keep)]:
            size = _size(run.path)
            if dry_run:
                removed.append((run, size))
                continue
            try:
                with RunLock(run):
                    shutil.rmtree(run.path)  # its lock file too; the lock is released as the block ends
            except RunLocked:
                continue
            removed.append((run, size))
    return removed
