"""Start one node's ranks of a case through torch's elastic agent, in a thread the harness watches.

Note: the agent (``torch.distributed.launcher.api.elastic_launch``) does the
rendezvous across nodes, the rank numbering, the per-rank environment and the
"one rank failed, stop the others" rule. It runs in a thread of the harness,
not a process of its own, so a case costs no extra Python start-up (importing
torch once more would add ~2 s per case). The ranks are forked from the
harness's fork server (``zbench.launch.forkserver``), which has imported
torch already, or started as fresh interpreters; their ``PR_SET_PDEATHSIG``
ties them to their parent, the harness or its fork server (which ends with
the harness). What the agent
does not do (a wall-clock limit per case, the ranks' stacks before a kill)
the harness does from outside, by signalling the ranks, which the agent then
sees die like any other failure.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from zbench.errors import UsageError
from zbench.launch import forkserver
from zbench.launch.handoff import CaseFiles

#: How long a rank gets to print its stacks (faulthandler on SIGUSR1) before it is killed.
STACK_DUMP_WAIT_S = 1.0
POLL_S = 0.2
#: How long the agent gets to notice killed ranks and return, after a timeout or an interrupt.
AGENT_EXIT_WAIT_S = 60.0


#: The agent's own loggers: it logs every launch at INFO and, run from a thread, warns that it cannot install
#: signal handlers. The harness reports what matters (the failing rank, a rendezvous timeout) itself.
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of a case meet: torchrun's ``--nnodes/--node-rank/--rdzv-endpoint``.

    One node is ``127.0.0.1:0``: a store on a free port, made for each case (``torchrun --standalone``).
    """

    endpoint: str = "127.0.0.1:0"
    nnodes: int = 1
    node_rank: int = 0
    timeout_s: float = 600.0

    @property
    def host(self) -> str:
        return self.endpoint.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])


def rendezvous(nnodes: int, node_rank: int, endpoint: str | None, timeout_s: float) -> Rendezvous:
    """The rendezvous from ``zbench run``'s torchrun-style flags, every inconsistency one ``UsageError``."""
    if nnodes == 1:
        if node_rank != 0 or endpoint is not None:
            raise UsageError("--node-rank and --rdzv-endpoint are for runs over several nodes: give --nnodes too")
        return Rendezvous(timeout_s=timeout_s)
    if endpoint is None:
        raise UsageError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: node 0's address and a free port")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} is not a node of --nnodes {nnodes} (0 to {nnodes - 1})")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT with a port from 1 to 65535")
    return Rendezvous(endpoint=endpoint, nnodes=nnodes, node_rank=node_rank, timeout_s=timeout_s)


class CaseLogs(LogsSpecs):
    """Each rank's output to ``rank<N>.log`` in the case's directory, named by global rank as the harness reads it.

    Note: the agent opens one file per stream, and two handles on one file would overwrite each other; so the
    worker points its stdout at its stderr first thing, and ``rank<N>.stdout`` keeps only what came before.
    """

    def __init__(self, files: CaseFiles) -> None:
        super().__init__(log_dir=str(files.workdir))
        self.files = files

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            dest.stdouts[local_rank] = str(self.files.workdir / f"rank{rank}.stdout")
            dest.stderrs[local_rank] = str(self.files.log(rank))
            dest.error_files[local_rank] = str(self.files.workdir / f"rank{rank}.elastic-error.json")
        return dest

    @property
    def root_log_dir(self) -> str:
        return str(self.files.workdir)


def worker_command(files: CaseFiles, device: str) -> tuple[str, list[str]]:
    """``env VAR=... python -m zbench.worker WORKDIR``: the agent passes no environment of the caller's choosing.

    Note: the user's PYTHONPATH first (``zbench ab`` puts the base checkout there), then the working directory,
    where suites' plug-in implementations usually live; PYTHONSAFEPATH stops ``python -m`` from putting the
    working directory ahead of them all (Python >= 3.11; ``zbench ab`` refuses older ones).
    """
    extra = forkserver.rank_env(device)
    extra["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), os.getcwd()) if p)
    extra["PYTHONSAFEPATH"] = "1"
    extra["PYTHONUNBUFFERED"] = "1"
    env_binary = shutil.which("env") or "/usr/bin/env"
    return env_binary, [
        *(f"{k}={v}" for k, v in extra.items()),
        sys.executable,
        "-m",
        "zbench.worker",
        str(files.workdir),
    ]


@dataclass
class AgentRun:
    """What the agent reported once it returned: the ranks that ended non-zero (rank -> exit code), first first."""

    failures: dict[int, int] = field(default_factory=dict)
    error: str | None = None


class LocalRanks:
    """This node's ranks of one case, started by the elastic agent in a background thread."""

    def __init__(self, files: CaseFiles, *, world_size: int, device: str, run_id: str, rdzv: Rendezvous) -> None:
        if world_size % rdzv.nnodes:
            raise ValueError(f"world size {world_size} does not split over {rdzv.nnodes} nodes")
        self.files = files
        self.rdzv = rdzv
        self.result = AgentRun()
        self.pids: list[int] = []
        entrypoint: Callable[..., int] | str
        args: list[object]
        if forkserver.can_fork(device):
            entrypoint, args = forkserver.forked_rank, forkserver.rank_arguments(str(files.workdir), device)
        else:
            entrypoint, command = worker_command(files, device)
            args = list(command)
        self._config = LaunchConfig(
            min_nodes=rdzv.nnodes,
            max_nodes=rdzv.nnodes,
            nproc_per_node=world_size // rdzv.nnodes,
            run_id=run_id,
            rdzv_backend="c10d",
            rdzv_endpoint=rdzv.endpoint,
            rdzv_configs={"is_host": rdzv.node_rank == 0, "join_timeout": rdzv.timeout_s},
            max_restarts=0,
            monitor_interval=0.05,
            logs_specs=CaseLogs(files),
            start_method="forkserver",  # used when the entry point is a function: forked ranks
        )
        self._thread = threading.Thread(
            target=self._run, args=(entrypoint, args), name=f"zbench-agent-{run_id}", daemon=True
        )

    def start(self) -> None:
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self._thread.start()

    def _run(self, entrypoint: Callable[..., int] | str, args: list[object]) -> None:
        try:
            elastic_launch(self._config, entrypoint)(*args)
        except ChildFailedError as exc:
            in_order = sorted(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
            # forked ranks: the agent names only the first it saw fail; each rank's own exit file names them all
            self.result.failures = self.files.exit_codes()
            for rank, failure in in_order:
                self.result.failures.setdefault(rank, failure.exitcode)
        except RendezvousTimeoutError:
            self.result.error = (
                f"rendezvous at {self.rdzv.endpoint} timed out after {self.rdzv.timeout_s:g} s: "
                f"not all {self.rdzv.nnodes} nodes joined"
            )
        except Exception as exc:  # a rendezvous or agent failure: the case fails, the suite goes on
            self.result.error = f"launcher: {type(exc).__name__}: {exc}"

    def running(self) -> bool:
        return self._thread.is_alive()

    def processes(self) -> list[psutil.Process]:
        """The case's rank processes among the harness's descendants: those whose pid file this case's directory
        holds (forked ranks), or whose command line names the directory (fresh ones, from their first instant)."""
        pids = self.files.rank_pids()
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.pid in pids or str(self.files.workdir) in child.cmdline():
                    found.append(child)
            except psutil.Error:  # it ended meanwhile
                continue
        self.pids.extend(p.pid for p in found if p.pid not in self.pids)
        return found

    def dump_stacks_and_kill(self) -> None:
        """Ask every rank to print its Python stacks (workers register faulthandler on SIGUSR1), then SIGKILL them."""
        self.signal(signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        self.signal(signal.SIGKILL)

    def signal(self, sig: signal.Signals) -> None:
        for proc in self.processes():
            try:
                proc.send_signal(sig)
            except psutil.Error:
                continue

    def wait(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)


def watch(ranks: LocalRanks, timeout_s: float, on_poll: Callable[[], None]) -> bool:
    """Start the ranks and wait for the agent to return; True when the case ran out of time (stacks dumped, killed).

    Note: whatever ends the wait (the agent, the timeout, Ctrl-C in the harness), no rank outlives it.
    """
    start = time.monotonic()
    ranks.start()
    timed_out = False
    try:
        while ranks.running():
            if time.monotonic() - start > timeout_s:
                timed_out = True
                ranks.dump_stacks_and_kill()
                break
            ranks.processes()  # remembers the ranks' pids for the record
            on_poll()
            time.sleep(POLL_S)
    finally:
        if ranks.running():
            ranks.signal(signal.SIGKILL)
        ranks.wait(AGENT_EXIT_WAIT_S)
    return timed_out
