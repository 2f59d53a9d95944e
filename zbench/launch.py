"""Run one case as its own process group: one subprocess per rank, a timeout, and a verdict on how it ended.

Note: every rank is started in one new process group so that a
timeout or a crashed peer can be answered by killing the whole group at once;
a rank stuck in a collective would otherwise outlive the harness.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zbench.case import Case
from zbench.handoff import CaseFiles, RankError, RankResult, WorkerTask
from zbench.values import Status

#: How long the surviving ranks get to notice a dead peer before the group is killed.
PEER_GRACE_S = 10.0
POLL_S = 0.2
STACK_DUMP_WAIT_S = 1.0
#: A free port can be taken by another program between choosing and binding it; then the case is relaunched.
PORT_ATTEMPTS = 3
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
    pids: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: glibc's initial mmap threshold (128 KiB), pinned for CPU ranks. By default glibc raises the threshold as
#: large blocks are freed, after which backward's freed transients stay in the heap, resident: peak RSS then
#: measured glibc's free lists (150-290 MiB on the 41M-parameter model, different every run) rather than what
#: the rank held, and hid what NVMe offload takes out of memory. Pinned, large blocks are mapped and unmapped
#: and RSS follows the bytes in use. A value the user exports is kept.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _env(rank: int, world: int, port: int, device: str = "cpu") -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":
        env = {**CPU_MALLOC_ENV, **env}
    # The user's PYTHONPATH first (``zbench ab`` puts the base checkout there), then the working directory,
    # where suites' plug-in implementations usually live; PYTHONSAFEPATH stops ``python -m`` from putting the
    # working directory ahead of them all (Python >= 3.11; ``zbench ab`` refuses older ones).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), os.getcwd()) if p)
    env["PYTHONSAFEPATH"] = "1"
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    return env


def _spawn(task: WorkerTask, files: CaseFiles, port: int) -> list[subprocess.Popen[bytes]]:
    case = task.case
    files.task.write_text(task.model_dump_json())
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(case.world_size):
        log = open(files.log(rank), "wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "zbench.worker", str(files.workdir)],
                env=_env(rank, case.world_size, port, case.device),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0 if rank == 0 else procs[0].pid,
            )
        )
        log.close()
    return procs


def dump_stacks(procs: list[subprocess.Popen[bytes]]) -> None:
    """Ask every rank to print its Python stacks (workers register faulthandler on SIGUSR1) before the kill."""
    try:
        os.killpg(procs[0].pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return
    time.sleep(STACK_DUMP_WAIT_S)


def kill_group(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every process of the case's group, then reap the ranks."""
    if procs:
        try:
            os.killpg(procs[0].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - group leader replaced by an unrelated process
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            p.kill()


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
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_case(task: WorkerTask, workdir: Path, *, on_progress: Callable[[str], None] = lambda _: None) -> Outcome:
    """Launch the case's ranks and classify the result; relaunch when the rendezvous port was taken meanwhile."""
    for attempt in range(PORT_ATTEMPTS):
        outcome = _run_once(task, CaseFiles(workdir / f"attempt{attempt}"), on_progress)
        if outcome.status != "error" or "address already in use" not in outcome.stderr_tail.lower():
            return outcome
    return outcome


def _run_once(task: WorkerTask, files: CaseFiles, on_progress: Callable[[str], None]) -> Outcome:
    case = task.case
    files.workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs = _spawn(task, files, free_port())
    timed_out = False
    first_failure_at: float | None = None
    died_before_kill: dict[int, int] = {}  # rank -> exit code, for ranks that ended on their own
    try:
        while True:
            codes = [p.poll() for p in procs]
            died_before_kill.update({r: c for r, c in enumerate(codes) if c not in (None, 0)})
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if now - start > case.timeout_s:
                timed_out = True
                dump_stacks(procs)
                break
            if any(c not in (None, 0) for c in codes):
                first_failure_at = first_failure_at or now
                if now - first_failure_at > PEER_GRACE_S:
                    break
            step = files.read_progress()
            on_progress(f"step {step}" if step else "starting ranks")
            time.sleep(POLL_S)
    finally:
        kill_group(procs)
    outcome = _classify(case, files, procs, timed_out, time.monotonic() - start, died_before_kill)
    outcome.pids = [p.pid for p in procs]
    return outcome


def _classify(
    case: Case,
    files: CaseFiles,
    procs: list[subprocess.Popen[bytes]],
    timed_out: bool,
    wall_s: float,
    died_before_kill: dict[int, int],
) -> Outcome:
    """ok, oom, timeout or error, and which rank to blame.

    Note: when one rank dies, its peers fail too (a broken connection in the
    next collective) and write error files of their own; a rank killed by a
    signal writes none. So a signal death seen before the harness killed the
    group is the cause, ahead of the peers' errors.
    """
    codes = [p.returncode for p in procs]
    ranks: list[RankResult] = []
    timed_errors: list[tuple[int, RankError]] = []
    for r in range(case.world_size):
        if files.result(r).exists():
            ranks.append(RankResult.model_validate_json(files.result(r).read_text()))
        if files.error(r).exists():
            timed_errors.append(
                (files.error(r).stat().st_mtime_ns, RankError.model_validate_json(files.error(r).read_text()))
            )
    # the first rank to fail is the cause; peers fail because it died
    errors = [e for _, e in sorted(timed_errors, key=lambda pair: pair[0])]
    error_ranks = {e.rank for e in errors}
    finished = {r.rank for r in ranks}
    signalled = [r for r, c in sorted(died_before_kill.items()) if c < 0 and r not in error_ranks | finished]
    failing_rank = errors[0].rank if errors else next((r for r, c in enumerate(codes) if c not in (0, None)), 0)
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
        outcome.error = f"rank {rank} {_describe_exit(died_before_kill[rank])} without a result"
    elif errors:
        outcome.status = "error"
        outcome.error = f"rank {errors[0].rank}: {errors[0].message}"
    elif len(ranks) == case.world_size:
        # every rank handed back its results, then one failed while shutting down: the measurements stand,
        # the crash is kept as a warning (it is the implementation's bug, not the harness's)
        outcome.warnings = [
            f"rank {r} {_describe_exit(c)} after writing its results (during shutdown)"
            for r, c in enumerate(codes)
            if c != 0
        ]
        if outcome.warnings:
            outcome.stderr_tail = _all_tails(files, case.world_size)
    elif any(c != 0 for c in codes) or len(ranks) != case.world_size:
        outcome.status = "error"
        outcome.error = f"rank {failing_rank} {_describe_exit(codes[failing_rank])} without a result"
    if outcome.status == "ok" and files.params.exists():
        outcome.params_path = files.params
    return outcome
