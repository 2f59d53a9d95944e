"""Results on disk (design §4) and the pandas loaders that read them back.

Layout::

    results/<run-id>/run.json              environment, suite, start/end
    results/<run-id>/cases/<case-id>.json  one per case, written atomically when it ends
    results/<run-id>/params/<case-id>.pt   final parameters, for equivalence checks

Every JSON file carries ``schema_version``. Files are written to a temporary
name in the same directory and renamed, so a reader (or a killed harness)
never sees half a file.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


def _file_mode() -> int:
    """The mode a plain ``open()`` would give a new file (mkstemp's 0600 honours no umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), json.dumps(obj, indent=1, default=str).encode())


def atomic_torch_save(obj: Any, path: Path) -> None:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


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

    @property
    def cases_dir(self) -> Path:
        return self.path / "cases"

    @property
    def params_dir(self) -> Path:
        return self.path / "params"

    def params_path(self, case_id: str) -> Path:
        return self.params_dir / f"{case_id}.pt"

    def case_path(self, case_id: str) -> Path:
        return self.cases_dir / f"{case_id}.json"

    def start(self, run_info: dict) -> None:
        self.cases_dir.mkdir(parents=True, exist_ok=True)
        self.params_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.cases_dir.glob(".*.tmp"), *self.params_dir.glob(".*.tmp")]:
            stale.unlink()  # half-written by a harness that was killed; never a result
        if not (self.path / "run.json").exists():
            self.write_run({**run_info, "started_at": now()})

    def write_run(self, run_info: dict) -> None:
        atomic_write_json(self.path / "run.json", {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **run_info})

    def run_info(self) -> dict:
        return read_json(self.path / "run.json")

    def finish(self) -> None:
        self.write_run({**self.run_info(), "ended_at": now()})

    def write_case(self, result: dict) -> None:
        atomic_write_json(self.case_path(result["case_id"]), {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **result})

    def cases(self) -> list[dict]:
        return [read_json(p) for p in sorted(self.cases_dir.glob("*.json"))]

    def stored_case_ids(self) -> set[str]:
        return {p.stem for p in self.cases_dir.glob("*.json")}


def run_dirs(results: Path) -> Iterator[RunDir]:
    """Every run under ``results`` (or ``results`` itself when it is one run's directory), oldest first."""
    results = Path(results)
    if (results / "run.json").exists():
        yield RunDir(results.parent, results.name)
        return
    for p in sorted(results.iterdir()) if results.is_dir() else []:
        if (p / "run.json").exists():
            yield RunDir(results, p.name)


def latest_run(results: Path) -> RunDir | None:
    runs = sorted(run_dirs(results), key=lambda r: r.run_info().get("started_at", ""))
    return runs[-1] if runs else None


CASE_COLUMNS = ("model", "implementation", "stage", "world_size", "precision", "offload", "device")


def load_cases(results: Path):
    """One row per case across every run under ``results``: config, status and summary figures."""
    import pandas as pd

    rows = []
    for run in run_dirs(results):
        info = run.run_info()
        for case in run.cases():
            summary = case.get("summary") or {}
            eq = case.get("equivalence") or {}
            state = case.get("model_state") or {}
            rows.append({
                "run_id": run.run_id, "git_sha": info.get("git_sha"), "started_at": info.get("started_at"),
                "case_id": case["case_id"], **{k: case["config"][k] for k in CASE_COLUMNS},
                "status": case["status"], "step_time_median_s": summary.get("step_time_median_s"),
                "step_time_iqr_s": summary.get("step_time_iqr_s"), "tokens_per_s": summary.get("tokens_per_s"),
                "ratio_to_ddp": case.get("ratio_to_ddp"), "peak_memory_bytes": (case.get("memory") or {}).get("peak_bytes"),
                "model_state_bytes": state.get("measured_total"), "expected_model_state_bytes": state.get("expected_total"),
                "max_rel_loss_diff": eq.get("max_rel_loss_diff"), "max_rel_param_diff": eq.get("max_rel_param_diff"),
                "equivalent": eq.get("equivalent"),
            })
    return pd.DataFrame(rows)


def load_steps(results: Path):
    """The tidy table: one row per (run, case, step) with loss, step time and whether it was warm-up."""
    import pandas as pd

    rows = []
    for run in run_dirs(results):
        for case in run.cases():
            for s in case.get("steps") or []:
                rows.append({"run_id": run.run_id, "case_id": case["case_id"],
                             **{k: case["config"][k] for k in CASE_COLUMNS}, "status": case["status"], **s})
    return pd.DataFrame(rows)


class RunLocked(Exception):
    """Another zbench process is writing this run."""


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for as long as a process writes the run (released if it dies)."""

    def __init__(self, run: RunDir) -> None:
        self.path = run.path / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(f"run {self.path.parent.name} is being written by another zbench process (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
