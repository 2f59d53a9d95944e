"""Results on disk and the pandas loaders that read them back.

Layout::

    results/<run-id>/run.json              RunInfo: environment, suite, start/end
    results/<run-id>/cases/<case-id>.json  CaseRecord: one per case, written atomically when it ends
    results/<run-id>/params/<case-id>.pt   final parameters, while the equivalence check needs them
    results/<run-id>/profiles/<case-id>/profile-rank<R>.json   torch.profiler traces (the suite's ``profile``)

Every JSON file carries ``schema_version``; older files are upgraded as they
are read (``zbench.results.record.migrate``). Files are written to a temporary name in
the same directory and renamed, so a reader (or a killed harness) never sees
half a file.
"""

from __future__ import annotations

import datetime
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from zbench.atomic import atomic_write_json
from zbench.errors import UsageError
from zbench.results.record import CaseRecord
from zbench.results.run_info import RunInfo

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    """Sortable by time, unique across concurrent runs on one machine."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


class RunDir:
    """One run's directory: create it, record its environment, add cases as they end."""

    def __init__(self, root: Path, run_id: str) -> None:
        self.root = Path(root)
        self.run_id = run_id
        self.path = self.root / run_id
        self._info: RunInfo | None = None

    @property
    def cases_dir(self) -> Path:
        return self.path / "cases"

    @property
    def params_dir(self) -> Path:
        return self.path / "params"

    @property
    def info_path(self) -> Path:
        return self.path / "run.json"

    @property
    def profiles_dir(self) -> Path:
        return self.path / "profiles"

    def params_path(self, case_id: str) -> Path:
        return self.params_dir / f"{case_id}.pt"

    def profile_path(self, case_id: str, name: str) -> Path:
        """Where a case's trace file ``name`` (``profile-rank<R>.json``) is kept."""
        return self.profiles_dir / case_id / name

    def case_path(self, case_id: str) -> Path:
        return self.cases_dir / f"{case_id}.json"

    def exists(self) -> bool:
        return self.info_path.exists()

    def start(self, info: RunInfo) -> None:
        """Create the run (or, resuming, keep its header) and drop files a killed harness left half-written."""
        self.cases_dir.mkdir(parents=True, exist_ok=True)
        self.params_dir.mkdir(parents=True, exist_ok=True)
        for stale in [
            *self.cases_dir.glob(".*.tmp"),
            *self.params_dir.glob(".*.tmp"),
            *self.profiles_dir.glob("*/.*.tmp"),
        ]:
            stale.unlink()
        if not self.exists():
            self.write_info(info.model_copy(update={"started_at": now()}))

    def write_info(self, info: RunInfo) -> None:
        atomic_write_json(self.info_path, info.to_json_dict())
        self._info = info

    def info(self) -> RunInfo:
        if self._info is None:
            self._info = _read(RunInfo.read, self.info_path)
        return self._info

    def finish(self) -> None:
        self.write_info(self.info().model_copy(update={"ended_at": now()}))

    def write_case(self, record: CaseRecord) -> None:
        atomic_write_json(
            self.case_path(record.case_id), record.model_copy(update={"run_id": self.run_id}).to_json_dict()
        )

    def cases(self) -> list[CaseRecord]:
        if _read_once is not None:
            key = (self.cases_dir.resolve(), self.cases_dir.stat().st_mtime_ns if self.cases_dir.is_dir() else 0)
            if key not in _read_once:
                _read_once[key] = self._read_cases()
            return list(_read_once[key])
        return self._read_cases()

    def _read_cases(self) -> list[CaseRecord]:
        return [_read(CaseRecord.read, p) for p in sorted(self.cases_dir.glob("*.json"))]

    def stored_case_ids(self) -> set[str]:
        return {p.stem for p in self.cases_dir.glob("*.json")}


_read_once: dict[tuple[Path, int], list[CaseRecord]] | None = None


@contextmanager
def cases_read_once() -> Iterator[None]:
    """Within the block, each run's records are read from disk once (while its ``cases/`` is unchanged) and the
    same objects handed to every reader: rendering reads each run three times over (the pages, the baseline
    check, the trends), a third of a 500-case report's time. Readers inside must not modify the records."""
    global _read_once
    outer, _read_once = _read_once, _read_once if _read_once is not None else {}
    try:
        yield
    finally:
        _read_once = outer


def _read(reader: Callable[[Path], T], path: Path) -> T:
    """A stored file, typed; one that is not valid JSON or does not fit its schema is bad input naming the file."""
    try:
        return reader(path)
    except (ValueError, ValidationError) as exc:  # JSONDecodeError and pydantic's errors are ValueErrors
        first = str(exc).strip().splitlines()
        raise UsageError(
            f"{path}: not a zbench result file this version can read ({first[0] if first else exc})"
        ) from None


def run_dirs(results: Path) -> Iterator[RunDir]:
    """Every run under ``results`` (or ``results`` itself when it is one run's directory), in directory order."""
    results = Path(results)
    if (results / "run.json").exists():
        yield RunDir(results.parent, results.name)
        return
    for p in sorted(results.iterdir()) if results.is_dir() else []:
        if (p / "run.json").exists():
            yield RunDir(results, p.name)


def runs_oldest_first(results: Path) -> list[RunDir]:
    return sorted(run_dirs(results), key=lambda r: r.info().started_at)


def latest_run(results: Path) -> RunDir | None:
    runs = runs_oldest_first(results)
    return runs[-1] if runs else None


def load_cases(results: Path) -> pd.DataFrame:
    """One row per case across every run under ``results``: its ``summary_row()`` plus the run's commit and start."""
    import pandas as pd

    rows = []
    for run in run_dirs(results):
        info = run.info()
        for case in run.cases():
            rows.append(
                {
                    "run_id": run.run_id,
                    "git_sha": info.git_sha,
                    "started_at": info.started_at,
                    **case.summary_row().model_dump(),
                }
            )
    return pd.DataFrame(rows)


STEP_IDENTITY = {
    "case_id",
    "model",
    "implementation",
    "stage",
    "world_size",
    "precision",
    "offload",
    "device",
    "status",
}
"""The columns of ``load_cases`` repeated on every row of ``load_steps``."""


def load_steps(results: Path) -> pd.DataFrame:
    """The tidy table: one row per (run, case, step) with loss, step time, phases, engine metrics and warm-up."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    for run in run_dirs(results):
        for case in run.cases():
            ident = {"run_id": run.run_id, **case.summary_row().model_dump(include=STEP_IDENTITY)}
            for s in case.steps:
                rows.append({**ident, **s.model_dump(exclude={"metrics"}), **s.metrics})
    return pd.DataFrame(rows)


class RunLocked(Exception):
    """Another zbench process is writing this run."""


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for as long as a process writes the run (released if it dies)."""

    def __init__(self, run: RunDir) -> None:
        self.path = run.path / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(
                f"run {self.path.parent.name} is being written by another zbench process (pid {holder})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
