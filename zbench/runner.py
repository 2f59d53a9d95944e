"""Run a suite: every case in turn, each stored the moment it ends, checked against DDP, then the report."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from zbench import environment, equivalence, nvme
from zbench.console import Progress
from zbench.errors import UsageError
from zbench.launch import run_case
from zbench.record import case_record, skipped_record
from zbench.store import RunDir, RunLock, RunLocked, atomic_write_bytes, new_run_id, now
from zbench.suite import Case, Suite

FAILED = ("error", "oom", "timeout")


@dataclass
class RunResult:
    run: RunDir
    records: list[dict]

    @property
    def failed(self) -> list[dict]:
        """Cases that did not run to the end, or that did not train like DDP."""
        return [r for r in self.records if r["status"] in FAILED
                or (r["status"] == "ok" and not (r.get("equivalence") or {}).get("equivalent", False))]


def prepare_run(results_root: Path, resume: str | None) -> RunDir:
    """The run directory to write into; fails early (before any work) when it cannot be written."""
    if resume is not None:
        run = RunDir(results_root, resume)
        if not (run.path / "run.json").exists():
            raise UsageError(f"--resume {resume}: no such run under {results_root}")
        return run
    run = RunDir(results_root, new_run_id())
    try:
        run.path.mkdir(parents=True)
        probe = run.path / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"results directory {results_root} is not writable: {exc.strerror}") from None
    return run


#: Refuse to start a run with less free space than this where results go.
MIN_FREE_BYTES = 64 * 2**20


def check_free_space(path: Path) -> None:
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_BYTES:
        raise UsageError(f"results directory {path} has only {free / 2**20:.0f} MiB free; "
                         f"zbench needs at least {MIN_FREE_BYTES / 2**20:.0f} MiB")


def run_suite(suite: Suite, *, results_root: Path, resume: str | None = None, progress: Progress) -> RunResult:
    """Run (or, with ``resume``, complete) a suite; a failure to store results stops it with a ``UsageError``."""
    run = prepare_run(results_root, resume)
    check_free_space(run.path)
    try:
        with RunLock(run):
            return _run_cases(suite, run, resume, progress)
    except RunLocked as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        stored = len(run.stored_case_ids()) if run.cases_dir.exists() else 0
        raise UsageError(f"cannot write results under {run.path}: {exc.strerror or exc}; "
                         f"{stored} case(s) stored so far, complete with --resume {run.run_id}") from None


def _run_cases(suite: Suite, run: RunDir, resume: str | None, progress: Progress) -> RunResult:
    run.start({"suite": {"name": suite.config.name, "path": suite.path, "sha256": suite.sha256,
                         "config": suite.config.model_dump()},
               "environment": environment.collect(), "git_sha": environment.git_sha(),
               "case_order": [c.case_id for c in suite.cases]})
    stored = run.stored_case_ids() if resume else set()
    records: dict[str, dict] = {r["case_id"]: r for r in run.cases()} if resume else {}
    progress.start(run.run_id, run.path, len(suite.cases))
    for index, case in enumerate(suite.cases, 1):
        if case.case_id in stored:
            progress.case_reused(index, case, records[case.case_id])
            continue
        record = skipped_record(case) if case.skip_reason else _run_guarded(case, run, records, index, progress)
        run.write_case(record)
        records[case.case_id] = record
        progress.case_done(index, case, record)
    run.finish()
    ordered = [records[c.case_id] for c in suite.cases if c.case_id in records]
    progress.summary(ordered)
    return RunResult(run=run, records=ordered)


def _run_guarded(case: Case, run: RunDir, records: dict[str, dict], index: int, progress: Progress) -> dict:
    """Run a case; a bug in the harness's own handling of it is recorded as that case's error, not a dead suite."""
    try:
        return _run_one(case, run, records, index, progress)
    except OSError:
        raise  # the results cannot be stored (disk full, read-only): stop the run, not just this case
    except Exception as exc:
        import traceback

        return {**skipped_record(case), "status": "error", "skip_reason": None,
                "error": f"harness error: {type(exc).__name__}: {exc}", "stderr_tail": traceback.format_exc()[-4000:]}


def _run_one(case: Case, run: RunDir, records: dict[str, dict], index: int, progress: Progress) -> dict:
    started_at, t0 = now(), time.monotonic()
    try:
        with nvme.case_directory(case, run.run_id) as swap_dir, \
                tempfile.TemporaryDirectory(prefix=f"zbench-{case.case_id}-") as tmp:
            return _launch(case, run, records, index, progress, swap_dir, Path(tmp), started_at, t0)
    except UsageError as exc:  # the NVMe directory went away or filled up since the suite was checked
        return {**skipped_record(case), "status": "error", "skip_reason": None, "error": str(exc),
                "started_at": started_at, "ended_at": now()}


def _launch(case: Case, run: RunDir, records: dict[str, dict], index: int, progress: Progress, swap_dir: str | None,
            tmp: Path, started_at: str, t0: float) -> dict:
    """Launch the case's ranks (pointed at its private NVMe directory, if any) and turn what they left into a record."""
    progress.case_started(index, case)
    launched = case if swap_dir is None else replace(case, nvme_dir=swap_dir)
    outcome = run_case(launched, tmp, on_progress=lambda what: progress.case_update(index, case, what, time.monotonic() - t0))
    record = case_record(case, outcome, started_at=started_at, ended_at=now())
    if outcome.params_path is not None:
        atomic_write_bytes(run.params_path(case.case_id), outcome.params_path.read_bytes())
        record["params_file"] = str(run.params_path(case.case_id).relative_to(run.path))
    if record["status"] == "ok":
        _compare_with_reference(case, record, run, records)
    return record


def _compare_with_reference(case: Case, record: dict, run: RunDir, records: dict[str, dict]) -> None:
    reference = next((r for r in records.values() if r["config"]["implementation"] == "ddp"
                      and Case.from_dict(r["config"]).reference_key == case.reference_key), None) if not case.is_reference else record
    if reference is None or reference["status"] != "ok":
        why = "no DDP case with the same model, world size, precision and seed" if reference is None \
            else f"the DDP reference {reference['case_id']} did not finish ({reference['status']})"
        record["equivalence"] = {"equivalent": False, "reason": f"not checked: {why}"}
        return
    ref_median = reference["summary"]["step_time_median_s"]
    record["ratio_to_ddp"] = record["summary"]["step_time_median_s"] / ref_median if ref_median else None
    record["equivalence"] = equivalence.verdict(
        losses=[s["loss"] for s in record["steps"]], reference_losses=[s["loss"] for s in reference["steps"]],
        params_path=run.path / record["params_file"] if "params_file" in record else None,
        reference_params_path=run.path / reference["params_file"] if "params_file" in reference else None,
        precision=case.precision, reference_case=reference["case_id"])
