"""Run one case as a process group started by torch's elastic agent, with a timeout and a verdict on how it ended.

Note: ``zbench.launch.elastic`` starts this node's ranks; with several nodes
(``zbench.launch.nodes``) the other nodes start theirs for the same case and send
their ranks' files here, so that the case is classified from one directory
whatever the number of nodes.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from zbench.cases.case import Case
from zbench.launch import slurm
from zbench.launch.elastic import LocalRanks, Rendezvous, watch
from zbench.launch.handoff import CaseFiles, RankError, RankResult, WorkerTask
from zbench.values import Status

if TYPE_CHECKING:
    from zbench.launch.nodes import NodeGroup

STDERR_TAIL_LINES = 40


@dataclass
class Outcome:
    """How a launch ended and what its ranks handed back."""

    status: Status
    ranks: list[RankResult] = field(default_factory=list)
    error: str | None = None
    stderr_tail: str = ""
    exit_codes: list[int | None] = field(default_factory=list)
    wall_s: float = 0.0
    params_path: Path | None = None
    probe_params_path: Path | None = None
    """The fp32 probe's final parameters (``Case.fp32_probe``), when it ran."""
    profile_paths: list[Path] = field(default_factory=list)
    """The ranks' profiler traces (``CaseFiles.profile``), whatever the status: a failed case's may show why."""
    pids: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Launcher:
    """How a case's ranks start: torch's elastic agent on this node (with ``nodes``, on several), or ``srun``."""

    kind: Literal["elastic", "slurm"] = "elastic"
    nodes: NodeGroup | None = None

    @property
    def nnodes(self) -> int:
        if self.kind == "slurm":
            return slurm.allocation_nodes()
        return self.nodes.rendezvous.nnodes if self.nodes is not None else 1

    def work_root(self, run_path: Path) -> Path | None:
        """Where a case's files go: under the run for srun (its ranks on other nodes must see them), else tmp."""
        return run_path if self.kind == "slurm" else None


#: The launcher unless told otherwise: the elastic agent, on this node alone.
ONE_NODE = Launcher()


@dataclass
class _Ended:
    """How the ranks' launcher ended: out of time, the ranks it saw fail first (rank -> exit code), its own error."""

    timed_out: bool
    failures: dict[int, int]
    error: str | None
    pids: list[int]


def run_case(
    task: WorkerTask,
    workdir: Path,
    *,
    on_progress: Callable[[str], None] = lambda _: None,
    launcher: Launcher = ONE_NODE,
) -> Outcome:
    """Launch the case's ranks (on every node) and classify the result."""
    case = task.case
    files = CaseFiles(workdir)
    files.workdir.mkdir(parents=True, exist_ok=True)
    files.task.write_text(task.model_dump_json())
    start = time.monotonic()

    def poll() -> None:
        on_progress(_progress(files))

    if launcher.kind == "slurm":
        ended = _run_srun(case, files, launcher, poll)
    else:
        ended = _run_elastic(task, files, launcher.nodes, poll)
    outcome = _classify(case, files, ended.timed_out, time.monotonic() - start, ended.failures, ended.error)
    outcome.pids = ended.pids
    return outcome


def _run_elastic(task: WorkerTask, files: CaseFiles, nodes: NodeGroup | None, poll: Callable[[], None]) -> _Ended:
    """This node's ranks through the elastic agent; with other nodes, theirs too, their files merged into ``files``."""
    run_id = f"zbench-{uuid.uuid4().hex[:12]}"
    if nodes is not None:
        nodes.announce(task, run_id)
    ranks = LocalRanks(
        files,
        world_size=task.case.world_size,
        device=task.case.device,
        run_id=run_id,
        rdzv=nodes.rendezvous if nodes is not None else Rendezvous(),
    )
    ended = _Ended(watch(ranks, task.case.timeout_s, poll), dict(ranks.result.failures), ranks.result.error, ranks.pids)
    if nodes is not None:
        remote = nodes.collect(files, timeout_s=task.case.timeout_s)
        ended.failures.update(remote.failures)
        ended.pids += remote.pids
        ended.timed_out = ended.timed_out or remote.timed_out
        ended.error = ended.error or next(iter(remote.errors), None)
    return ended


def _run_srun(case: Case, files: CaseFiles, launcher: Launcher, poll: Callable[[], None]) -> _Ended:
    step = slurm.SrunStep(files, case.world_size, case.device, launcher.nnodes, case.timeout_s)
    timed_out = step.run(poll)
    return _Ended(timed_out, step.failures, step.error, step.pids)


def _progress(files: CaseFiles) -> str:
    step = files.read_progress()
    return f"step {step}" if step else "starting ranks"


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _all_tails(files: CaseFiles, world: int) -> str:
    """Every rank's last lines: when no single rank explains the failure (a hang, a silent kill)."""
    return "\n".join(f"--- rank {r} ---\n{_tail(files.log(r), STDERR_TAIL_LINES // world)}" for r in range(world))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped by the launcher"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _died_on_their_own(failures: dict[int, int]) -> dict[int, int]:
    """The failures less the ranks the agent stopped: it ends the peers of a failed rank with SIGTERM.

    Note: a rank that a user or the system ended with SIGTERM is counted as stopped too, unless it is the only
    kind of failure there is.
    """
    own = {r: c for r, c in failures.items() if c != -signal.SIGTERM}
    return own or failures


def _classify(
    case: Case, files: CaseFiles, timed_out: bool, wall_s: float, failures: dict[int, int], launch_error: str | None
) -> Outcome:
    """ok, oom, timeout or error, and which rank to blame.

    ``failures``: every rank that ended non-zero (global rank -> exit code), in
    the order the launcher saw them end, the ones the agent stopped with
    SIGTERM after the first failure included.

    Note: a rank that raised writes an error file; a rank killed by a signal
    writes none, and its peers may have failed in their next collective and
    written errors of their own meanwhile. So a signal death the agent saw is
    the cause, ahead of the peers' errors; among errors, the earliest.
    """
    ranks: list[RankResult] = []
    timed_errors: list[tuple[int, RankError]] = []
    for r in range(case.world_size):
        if files.result(r).exists():
            ranks.append(RankResult.model_validate_json(files.result(r).read_text()))
        if files.error(r).exists():
            timed_errors.append(
                (files.error(r).stat().st_mtime_ns, RankError.model_validate_json(files.error(r).read_text()))
            )
    finished = {r.rank for r in ranks}
    codes: list[int | None] = [failures.get(r, 0 if r in finished else None) for r in range(case.world_size)]
    errors = [e for _, e in sorted(timed_errors, key=lambda pair: pair[0])]
    error_ranks = {e.rank for e in errors}
    died = _died_on_their_own(failures)
    signalled = [r for r, c in died.items() if c < 0 and r not in error_ranks | finished]  # in the order seen
    failing_rank = errors[0].rank if errors else min(died, default=0)
    tail = _tail(files.log(failing_rank)) if errors and not signalled else _all_tails(files, case.world_size)
    outcome = Outcome(status="ok", ranks=ranks, exit_codes=codes, wall_s=wall_s, stderr_tail=tail)
    if timed_out:
        outcome.status = "timeout"
        step = files.read_progress() or "before the first step"
        outcome.error = f"timed out after {case.timeout_s:g} s (at step {step}); process group killed"
    elif any(e.kind == "oom" for e in errors):
        outcome.status = "oom"
        outcome.error = next(e for e in errors if e.kind == "oom").message
    elif signalled:
        rank = signalled[0]
        outcome.status = "error"
        outcome.error = f"rank {rank} {_describe_exit(died[rank])} without a result"
    elif errors:
        outcome.status = "error"
        outcome.error = f"rank {errors[0].rank}: {errors[0].message}"
    elif launch_error is not None and len(ranks) != case.world_size:
        outcome.status = "error"
        outcome.error = launch_error
    elif len(ranks) == case.world_size:
        # every rank handed back its results, then one failed while shutting down: the measurements stand,
        # the crash is kept as a warning (it is the implementation's bug, not the harness's); a peer the agent
        # then stopped with SIGTERM (while it shut down, slower under load or coverage) is not a crash of its own
        outcome.warnings = [
            f"rank {r} {_describe_exit(c)} after writing its results (during shutdown)" for r, c in sorted(died.items())
        ]
        if outcome.warnings:
            outcome.stderr_tail = _all_tails(files, case.world_size)
    else:
        missing = min(died) if died else next(r for r in range(case.world_size) if r not in finished)
        outcome.status = "error"
        outcome.error = f"rank {missing} {_describe_exit(codes[missing])} without a result"
    if outcome.status == "ok" and files.params.exists():
        outcome.params_path = files.params
    if outcome.status == "ok" and files.probe_params.exists():
        outcome.probe_params_path = files.probe_params
    outcome.profile_paths = files.profiles(case.world_size)
    return outcome
