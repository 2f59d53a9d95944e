"""Start a case's ranks with SLURM's ``srun``, one step per case, inside an ``sbatch`` allocation.

Note: ``srun`` starts every rank on the allocation's nodes and sets
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and ``SLURM_NODEID``;
the worker reads its rank and world from them. The ranks meet at a TCPStore
the harness hosts for the case on a free port (no port to pick, no race for
one), and write their files into the case's directory, which lies under the
run directory: it must be on a filesystem every node sees, as SLURM
clusters' home and scratch filesystems are. ``srun --kill-on-bad-exit``
stops the step when a rank fails; the harness keeps the timeout, the stacks
(``srun`` forwards SIGUSR1 to every task) and the kill.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed import TCPStore

from zbench.errors import UsageError
from zbench.launch.elastic import STACK_DUMP_WAIT_S, worker_command
from zbench.launch.handoff import CaseFiles

#: How long ``srun`` gets to pass SIGTERM on to its tasks and return before it is killed.
TERM_WAIT_S = 10.0


def allocation_nodes() -> int:
    """The nodes of the allocation zbench runs in (``sbatch --nodes``), over which every case is spread."""
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)


def srun_binary() -> str:
    found = shutil.which("srun")
    if found is None:
        raise UsageError("--launcher slurm needs srun on PATH: run zbench inside an sbatch or salloc allocation")
    return found


def store_host() -> str:
    """The address the ranks reach the harness at: this node's name, as SLURM's own nodes know it."""
    return os.environ.get("ZBENCH_STORE_HOST") or socket.gethostname()


@dataclass
class SrunStep:
    """One case's ``srun`` step and the store its ranks meet at."""

    files: CaseFiles
    world_size: int
    device: str
    nnodes: int
    timeout_s: float
    failures: dict[int, int] = field(default_factory=dict)
    error: str | None = None
    pids: list[int] = field(default_factory=list)

    def command(self, store_port: int) -> list[str]:
        env_binary, args = worker_command(self.files, self.device)
        store = f"ZBENCH_STORE={store_host()}:{store_port}"
        return [
            srun_binary(),
            f"--ntasks={self.world_size}",
            f"--nodes={self.nnodes}",
            f"--ntasks-per-node={self.world_size // self.nnodes}",
            "--kill-on-bad-exit=1",
            f"--output={self.files.workdir}/rank%t.log",
            env_binary,
            store,
            *args,
        ]

    def run(self, on_poll: Callable[[], None] = lambda: None) -> bool:
        """Run the step to its end; True when it ran out of time (stacks asked for, step killed)."""
        store = TCPStore(
            "0.0.0.0",
            0,
            self.world_size + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        srun_log = self.files.workdir / "srun.log"
        with open(srun_log, "wb") as log:
            proc = subprocess.Popen(self.command(store.port), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.pids = [proc.pid]
        start, timed_out = time.monotonic(), False
        try:
            while proc.poll() is None:
                if time.monotonic() - start > self.timeout_s:
                    timed_out = True
                    proc.send_signal(signal.SIGUSR1)
                    time.sleep(STACK_DUMP_WAIT_S)
                    break
                on_poll()
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(TERM_WAIT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if proc.returncode and not timed_out:
            said = srun_log.read_text(errors="replace")
            self.failures = task_failures(said) or self._ranks_without_files(proc.returncode)
            if not self.failures:
                self.error = f"srun exited with code {proc.returncode}: {said.strip()[-500:]}"
        return timed_out

    def _ranks_without_files(self, code: int) -> dict[int, int]:
        """When srun named no task: its one exit code, blamed on the ranks that left no result and no error."""
        silent = [
            r for r in range(self.world_size) if not self.files.result(r).exists() and not self.files.error(r).exists()
        ]
        errored = [r for r in range(self.world_size) if self.files.error(r).exists()]
        return {r: _as_exit(code) for r in (silent or errored)}


#: srun's words for a task killed by a signal (``strsignal``: "Killed", "Aborted", ...), to the signal.
_SIGNAL_BY_NAME = {signal.strsignal(s): s for s in signal.Signals if signal.strsignal(s)}
_TASK_LINE = re.compile(r"task (\d+): (?:Exited with exit code (\d+)|(.+))$")


def task_failures(srun_output: str) -> dict[int, int]:
    """Each task srun says ended badly (``srun: error: node1: task 1: Killed``), in the order it said them.

    Note: srun prints one such line per failed task, the first failure first; "Exited with exit code N" for a
    task that exited, the signal's description for one that was killed.
    """
    failures: dict[int, int] = {}
    for line in srun_output.splitlines():
        found = _TASK_LINE.search(line.strip())
        if not found or int(found[1]) in failures:
            continue
        if found[2] is not None:
            failures[int(found[1])] = int(found[2])
        elif found[3] in _SIGNAL_BY_NAME:
            failures[int(found[1])] = -_SIGNAL_BY_NAME[found[3]]
    return failures


def _as_exit(code: int) -> int:
    """srun, like a shell, says 128+N for a task killed by signal N."""
    return -(code - 128) if code > 128 else code
