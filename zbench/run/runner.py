"""Run a suite: every case in turn, each stored the moment it ends, checked against DDP, then the report."""

from __future__ import annotations

import shutil
import tempfile
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from zbench.atomic import move_into_place
from zbench.cases.case import Case
from zbench.errors import UsageError
from zbench.launch.handoff import WorkerTask
from zbench.launch.launcher import ONE_NODE, Launcher, run_case
from zbench.results.record import CaseRecord, Fp32Probe
from zbench.results.run_info import RunInfo, SuiteInfo
from zbench.results.store import RunDir, RunLock, RunLocked, new_run_id, now
from zbench.run import environment
from zbench.run.aggregate import case_record, failed_record, skipped_record
from zbench.run.console import Progress
from zbench.suite import nvme
from zbench.suite.preflight import Suite
from zbench.verdicts import equivalence


@dataclass
class RunResult:
    run: RunDir
    records: list[CaseRecord]

    @property
    def failed(self) -> list[CaseRecord]:
        """Cases that did not run to the end, or that did not train like DDP."""
        return [r for r in self.records if r.failed]


def prepare_run(results_root: Path, resume: str | None) -> RunDir:
    """The run directory to write into; fails early (before any work) when it cannot be written."""
    if resume is not None:
        run = RunDir(results_root, resume)
        if not run.exists():
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
        raise UsageError(
            f"results directory {path} has only {free / 2**20:.0f} MiB free; "
            f"zbench needs at least {MIN_FREE_BYTES / 2**20:.0f} MiB"
        )


def run_suite(
    suite: Suite,
    *,
    results_root: Path,
    resume: str | None = None,
    progress: Progress,
    launcher: Launcher = ONE_NODE,
) -> RunResult:
    """Run (or, with ``resume``, complete) a suite; a failure to store results stops it with a ``UsageError``.

    With ``launcher.nodes`` (this is node 0 of several), every case also runs on the other nodes, which follow.
    """
    run = prepare_run(results_root, resume)
    check_free_space(run.path)
    try:
        with RunLock(run):
            return _run_cases(suite, run, resume, progress, launcher)
    except RunLocked as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        stored = len(run.stored_case_ids()) if run.cases_dir.exists() else 0
        raise UsageError(
            f"cannot write results under {run.path}: {exc.strerror or exc}; "
            f"{stored} case(s) stored so far, complete with --resume {run.run_id}"
        ) from None


def _run_cases(suite: Suite, run: RunDir, resume: str | None, progress: Progress, launcher: Launcher) -> RunResult:
    run.start(
        RunInfo(
            run_id=run.run_id,
            environment=launcher.nodes.hellos[0].environment if launcher.nodes else environment.collect(),
            nodes=[hello.environment for hello in launcher.nodes.hellos] if launcher.nodes else [],
            git_sha=environment.git_sha(),
            suite=SuiteInfo(
                name=suite.config.name,
                path=suite.path,
                sha256=suite.sha256,
                config=suite.config.model_dump(mode="json"),
            ),
            case_order=[c.case_id for c in suite.cases],
        )
    )
    records: dict[str, CaseRecord] = {r.case_id: r for r in run.cases()} if resume else {}
    references = References(run, records.values())
    by_id = {c.case_id: c for c in suite.cases}
    progress.start(run.run_id, run.path, len(suite.cases))
    for index, case in enumerate(suite.cases, 1):
        if case.case_id in records:
            progress.case_reused(index, case, records[case.case_id])
            continue
        for lost in [] if case.skip_reason or case.is_reference else references.lost_params(case):
            progress.note(
                f"[{index}/{len(suite.cases)}] re-running {lost.case_id}: "
                "its final parameters were deleted when the run finished"
            )
            rerun = by_id.get(lost.case_id, lost.config)  # the suite's case: it carries capabilities
            _store(_run_guarded(rerun, run, references, index, progress, launcher), run, records, references)
        record = (
            skipped_record(case) if case.skip_reason else _run_guarded(case, run, references, index, progress, launcher)
        )
        _store(record, run, records, references)
        progress.case_done(index, case, record)
    for record in references.release_params():
        records[record.case_id] = record
    run.finish()
    ordered = [records[c.case_id] for c in suite.cases if c.case_id in records]
    progress.summary(ordered)
    return RunResult(run=run, records=ordered)


def _store(record: CaseRecord, run: RunDir, records: dict[str, CaseRecord], references: References) -> None:
    run.write_case(record)
    records[record.case_id] = record
    references.add(record)


class References:
    """The DDP case of each case group, by ``Case.reference_key``, and the parameter files the verdicts need.

    Note: a case's own final parameters are deleted as soon as its verdict is
    stored; the reference's are needed by every later case of its group, so
    they go when the run ends (kept when the suite sets ``keep_params``).
    """

    def __init__(self, run: RunDir, stored: Iterable[CaseRecord]) -> None:
        self.run = run
        self._by_key: dict[tuple[object, ...], CaseRecord] = {}
        self._twins: dict[tuple[object, ...], CaseRecord] = {}
        for record in stored:
            self.add(record)

    def add(self, record: CaseRecord) -> None:
        if record.config.is_reference:
            self._by_key[record.config.reference_key] = record
        elif record.config.noise_twin:
            self._twins[record.config.reference_key] = record

    def find(self, case: Case, *, probe: bool = False) -> CaseRecord | None:
        """The case's DDP reference; ``probe``: the fp32 one its fp32 probe is judged against."""
        return self._by_key.get(self._key(case, probe))

    def twin(self, case: Case, *, probe: bool = False) -> CaseRecord | None:
        """The group's noise twin (``probe``: the fp32 group's), if it ran and finished with its parameters."""
        twin = self._twins.get(self._key(case, probe))
        return twin if twin is not None and twin.ok and self._has_params(twin) else None

    def _key(self, case: Case, probe: bool) -> tuple[object, ...]:
        """The group's key; for the probe, the first fp32 group that ran (``Case.probe_reference_keys``)."""
        if not probe:
            return case.reference_key
        keys = case.probe_reference_keys
        return next((k for k in keys if k in self._by_key), keys[0])

    def _has_params(self, record: CaseRecord) -> bool:
        """Its final parameters are stored, and those after the probes' step when it keeps them."""
        files = [record.params_file, *([record.probe_params_file] if record.config.probe_steps else [])]
        return all(f is not None and (self.run.path / f).exists() for f in files)

    def lost_params(self, case: Case) -> list[CaseRecord]:
        """The case's reference and twin that finished but whose parameters are gone (a finished run, resumed)."""
        keys = [case.reference_key, *(case.probe_reference_keys if case.fp32_probe else ())]
        lost = [group.get(key) for key in keys for group in (self._by_key, self._twins)]
        return [r for r in lost if r is not None and r.ok and not self._has_params(r)]

    def release_params(self) -> list[CaseRecord]:
        """Delete the references' and twins' parameter files (unless kept); the records, rewritten without them."""
        released = []
        for kept in (self._by_key, self._twins):
            for key, record in kept.items():
                if record.params_file is not None and not record.config.keep_params:
                    for kept_file in (record.params_file, record.probe_params_file):
                        if kept_file is not None:
                            (self.run.path / kept_file).unlink(missing_ok=True)
                    record = record.model_copy(update={"params_file": None, "probe_params_file": None})
                    self.run.write_case(record)
                    kept[key] = record
                    released.append(record)
        return released


def _run_guarded(
    case: Case, run: RunDir, references: References, index: int, progress: Progress, launcher: Launcher
) -> CaseRecord:
    """Run a case; a bug in the harness's own handling of it is recorded as that case's error, not a dead suite."""
    try:
        return _run_one(case, run, references, index, progress, launcher)
    except OSError:
        raise  # the results cannot be stored (disk full, read-only): stop the run, not just this case
    except Exception as exc:
        return failed_record(
            case, f"harness error: {type(exc).__name__}: {exc}", stderr_tail=traceback.format_exc()[-4000:]
        )


def _run_one(
    case: Case, run: RunDir, references: References, index: int, progress: Progress, launcher: Launcher
) -> CaseRecord:
    started_at, t0 = now(), time.monotonic()
    try:
        with (
            nvme.case_directory(case, run.run_id) as swap_dir,
            tempfile.TemporaryDirectory(prefix=f"zbench-{case.case_id}-", dir=launcher.work_root(run.path)) as tmp,
        ):
            progress.case_started(index, case)
            outcome = run_case(
                WorkerTask(case=case, swap_dir=swap_dir),
                Path(tmp),
                on_progress=lambda what: progress.case_update(index, case, what, time.monotonic() - t0),
                launcher=launcher,
            )
            record = case_record(case, outcome, started_at=started_at, ended_at=now())
            if outcome.params_path is not None:
                record.params_file = _keep_params(outcome.params_path, run, case.case_id)
            if outcome.probe_params_path is not None and record.probe is not None:
                record.probe.params_file = _keep_params(outcome.probe_params_path, run, f"{case.case_id}.fp32-probe")
            elif outcome.probe_params_path is not None and case.probe_steps:  # a reference, at the probes' step
                name = f"{case.case_id}.step{case.probe_steps}"
                record.probe_params_file = _keep_params(outcome.probe_params_path, run, name)
            record.profile_traces = _keep_profiles(outcome.profile_paths, run, case)
    except UsageError as exc:  # the NVMe directory went away or filled up since the suite was checked
        return failed_record(case, str(exc), started_at=started_at, ended_at=now())
    if record.ok:
        reference = references.find(case) if not case.is_reference else record
        # the twin is the noise floor itself: judged against itself as the noise, its margins are 1/multiple
        twin = record if case.noise_twin else references.twin(case)
        probe = _probe_evidence(record.probe, case, run, references) if record.probe is not None else None
        _compare_with_reference(record, run, reference, twin, probe)
    if record.params_file is not None and not case.is_reference and not case.noise_twin and not case.keep_params:
        (run.path / record.params_file).unlink(missing_ok=True)
        record.params_file = None
    if record.probe is not None and record.probe.params_file is not None and not case.keep_params:
        (run.path / record.probe.params_file).unlink(missing_ok=True)
        record.probe.params_file = None
    return record


def _keep_params(written: Path, run: RunDir, name: str) -> str:
    """Move a parameter file the ranks wrote into the run as ``name``; its path relative to the run directory."""
    target = run.params_path(name)
    move_into_place(written, target)
    return str(target.relative_to(run.path))


def _probe_evidence(probe: Fp32Probe, case: Case, run: RunDir, references: References) -> equivalence.ProbeEvidence:
    """The fp32 probe's run with the fp32 reference and twin of its group, for its verdict."""
    reference = references.find(case, probe=True)
    twin = references.twin(case, probe=True)

    def params_of(record: CaseRecord | None) -> Path | None:
        """Its parameters after as many steps as the probe trained: its final ones, or those it kept there."""
        steps = len(probe.losses)
        if record is None or steps not in (record.config.steps, record.config.probe_steps):
            return None  # (a resumed run's reference, kept at another step)
        kept = record.params_file if record.config.steps == steps else record.probe_params_file
        return run.path / kept if kept else None

    return equivalence.ProbeEvidence(
        probe=probe,
        reference=reference,
        twin=twin,
        params_path=run.path / probe.params_file if probe.params_file else None,
        reference_params_path=params_of(reference),
        twin_params_path=params_of(twin),
        case_steps=case.steps,
    )


def _keep_profiles(traces: list[Path], run: RunDir, case: Case) -> list[str]:
    """Move the ranks' profiler traces out of the case's work directory (deleted next) into the run; their paths,
    relative to the run directory."""
    kept = []
    for trace in traces:
        target = run.profile_path(case.case_id, trace.name)
        move_into_place(trace, target)
        kept.append(str(target.relative_to(run.path)))
    return kept


def _compare_with_reference(
    record: CaseRecord,
    run: RunDir,
    reference: CaseRecord | None,
    twin: CaseRecord | None,
    probe: equivalence.ProbeEvidence | None = None,
) -> None:
    if reference is None or not reference.ok:
        why = (
            "no DDP case with the same model, world size, precision and seed"
            if reference is None
            else f"the DDP reference {reference.case_id} did not finish ({reference.status})"
        )
        record.equivalence = equivalence.not_checked(why)
        return
    ref_median = reference.step_time_median_s
    median = record.step_time_median_s
    paired_ratio = record.paired.median_ratio if record.paired else None
    record.ratio_to_ddp = paired_ratio or (median / ref_median if median and ref_median else None)
    record.equivalence = equivalence.verdict(
        record,
        reference,
        twin,
        params_path=run.path / record.params_file if record.params_file else None,
        reference_params_path=run.path / reference.params_file if reference.params_file else None,
        twin_params_path=run.path / twin.params_file if twin and twin.params_file else None,
        probe=probe,
    )
