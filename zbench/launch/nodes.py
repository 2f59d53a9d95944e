"""One suite over several nodes: node 0 leads and writes, the others follow, through one store at the endpoint.

Note: every node runs ``zbench run SUITE --nnodes N --node-rank R
--rdzv-endpoint HOST:PORT`` (torchrun's flags). Node 0 hosts a TCPStore at
the endpoint for the whole run; the elastic agent's c10d rendezvous for
each case shares it (a multi-tenant store in the same process), under its
own per-case prefix. Over the same store node 0 hands each case to the
others, and they send back their ranks' files (results, errors, logs,
profiler traces, the final parameters when global rank 0 ran there), so
node 0 classifies and stores the case as if every rank had run on it. Node 0
is the only writer of results and reports; a follower keeps nothing.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel
from torch.distributed import TCPStore

from zbench.errors import UsageError
from zbench.launch.elastic import LocalRanks, Rendezvous, watch
from zbench.launch.handoff import CaseFiles, WorkerTask
from zbench.results.run_info import Environment

#: A follower's wait for node 0's next case is cut into slices this long, so that a vanished node 0 is noticed.
WAIT_SLICE_S = 30.0
#: How long node 0 waits for a follower's report beyond the case's own timeout (the follower's agent winding up).
REPORT_GRACE_S = 60.0
#: The end of a log a follower sends back: the report needs the tail, never the whole of a chatty rank's output.
LOG_BYTES_SENT = 64 * 1024
#: Files cross the store in pieces this large: its server refuses a message over 8 MiB, and the final parameters
#: of even the 41M-parameter model are 164 MB.
CHUNK_BYTES = 4 * 2**20
_DONE = "done"


class NodeHello(BaseModel):
    """What each node says when it joins: enough for node 0 to refuse a mismatch and to record the machine."""

    node_rank: int
    suite_sha256: str
    environment: Environment


class SentFile(BaseModel):
    """A file a follower put into the store, in ``chunks`` pieces under the report's key."""

    name: str
    chunks: int
    mtime_ns: int


class NodeReport(BaseModel):
    """A follower's account of its ranks for one case."""

    node_rank: int
    failures: dict[int, int] = {}
    pids: list[int] = []
    timed_out: bool = False
    error: str | None = None
    files: list[SentFile] = []


@dataclass
class RemoteRanks:
    """The other nodes' ranks of one case, as node 0 merges them."""

    failures: dict[int, int] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    timed_out: bool = False
    errors: list[str] = field(default_factory=list)


class NodeGroup:
    """This node's place in a multi-node run and the store the nodes talk through."""

    def __init__(self, rdzv: Rendezvous, store: TCPStore, hellos: list[NodeHello]) -> None:
        self.rendezvous = rdzv
        self.store = store
        self.hellos = hellos
        self._seq = 0

    @property
    def leader(self) -> bool:
        return self.rendezvous.node_rank == 0

    def __enter__(self) -> NodeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        """Node 0 tells the followers the suite is over however it ended, so none waits for a case that never comes."""
        if self.leader:
            self.finish()

    @classmethod
    def join(cls, rdzv: Rendezvous, *, suite_sha256: str, environment: Environment) -> NodeGroup:
        """Meet the other nodes at the endpoint, or fail in one line when they do not all come in time."""
        # the workers of a case get a store of their own: the shared one would keep one case's keys under the
        # prefix the next case's workers use (every case is attempt 0)
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        timeout = datetime.timedelta(seconds=rdzv.timeout_s)
        try:
            store = TCPStore(
                rdzv.host,
                rdzv.port,
                is_master=rdzv.node_rank == 0,
                multi_tenant=True,
                wait_for_workers=False,
                timeout=timeout,
            )
        except (RuntimeError, TimeoutError) as exc:
            role = "host" if rdzv.node_rank == 0 else "reach"
            raise UsageError(f"cannot {role} the rendezvous store at {rdzv.endpoint}: {_first_line(exc)}") from None
        hello = NodeHello(
            node_rank=rdzv.node_rank,
            suite_sha256=suite_sha256,
            environment=environment,
        )
        store.set(f"zbench/node/{rdzv.node_rank}", hello.model_dump_json())
        keys = [f"zbench/node/{r}" for r in range(rdzv.nnodes)]
        try:
            store.wait(keys, timeout)
        except (RuntimeError, TimeoutError):
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise UsageError(
                f"rendezvous at {rdzv.endpoint} timed out after {rdzv.timeout_s:g} s: "
                f"node rank(s) {', '.join(map(str, missing))} of {rdzv.nnodes} did not join"
            ) from None
        hellos = [NodeHello.model_validate_json(store.get(key)) for key in keys]
        differing = [h.node_rank for h in hellos if h.suite_sha256 != hello.suite_sha256]
        if differing:
            raise UsageError(
                f"node rank(s) {', '.join(map(str, differing))} run a different suite (or different --set "
                "overrides) than this node: every node must be given the same suite"
            )
        return cls(rdzv, store, hellos)

    # -- node 0 -------------------------------------------------------------------------------------------------

    def announce(self, task: WorkerTask, run_id: str) -> None:
        """Hand the next case to the followers (node 0)."""
        self._seq += 1
        self.store.set(f"zbench/case/{self._seq}", f"{run_id}\n{task.model_dump_json()}")

    def collect(self, files: CaseFiles, *, timeout_s: float) -> RemoteRanks:
        """Wait for every follower's report of the case just announced and put its files into ``files`` (node 0)."""
        merged = RemoteRanks()
        for node in range(1, self.rendezvous.nnodes):
            key = f"zbench/case/{self._seq}/from/{node}"
            try:
                self.store.wait([key], datetime.timedelta(seconds=timeout_s + REPORT_GRACE_S))
            except (RuntimeError, TimeoutError):
                merged.errors.append(f"node {node} sent no report of its ranks")
                continue
            report = NodeReport.model_validate_json(self.store.get(key))
            self.store.delete_key(key)
            merged.failures.update(report.failures)
            merged.pids += report.pids
            merged.timed_out = merged.timed_out or report.timed_out
            if report.error:
                merged.errors.append(f"node {node}: {report.error}")
            for index, sent in enumerate(report.files):
                path = files.workdir / Path(sent.name).name
                with open(path, "wb") as out:
                    for chunk in range(sent.chunks):
                        out.write(self.store.get(f"{key}/file{index}/{chunk}"))
                        self.store.delete_key(f"{key}/file{index}/{chunk}")
                os.utime(path, ns=(sent.mtime_ns, sent.mtime_ns))
        return merged

    def finish(self) -> None:
        """Tell the followers the suite is over and give them a moment to read it before the store goes (node 0)."""
        self.store.set(f"zbench/case/{self._seq + 1}", _DONE)
        keys = [f"zbench/bye/{node}" for node in range(1, self.rendezvous.nnodes)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=WAIT_SLICE_S))
        except (RuntimeError, TimeoutError):
            pass

    # -- the other nodes ----------------------------------------------------------------------------------------

    def follow(self, on_case: Callable[[WorkerTask, str], None] = lambda task, what: None) -> int:
        """Run this node's ranks of every case node 0 announces, until it says the suite is over; the case count."""
        seq = 0
        while True:
            seq += 1
            message = self._next(seq)
            if message == _DONE:
                self.store.set(f"zbench/bye/{self.rendezvous.node_rank}", "1")
                return seq - 1
            run_id, task_json = message.split("\n", 1)
            task = WorkerTask.model_validate_json(task_json)
            on_case(task, "started")
            key = f"zbench/case/{seq}/from/{self.rendezvous.node_rank}"
            try:
                report = self._run_local(task, run_id, key)
                self.store.set(key, report.model_dump_json())  # last: node 0 reads the files once it sees this
            except RuntimeError as exc:  # the store's connection: node 0 is gone
                raise UsageError(f"lost node 0 at {self.rendezvous.endpoint}: {_first_line(exc)}") from None
            on_case(task, "failed" if report.failures or report.error or report.timed_out else "done")

    def _next(self, seq: int) -> str:
        key = f"zbench/case/{seq}"
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=WAIT_SLICE_S))
                return self.store.get(key).decode()
            except TimeoutError:
                continue  # node 0 is still busy with the previous case
            except RuntimeError as exc:
                if "timeout" in str(exc).lower():
                    continue
                raise UsageError(f"lost node 0 at {self.rendezvous.endpoint}: {_first_line(exc)}") from None

    def _run_local(self, task: WorkerTask, run_id: str, key: str) -> NodeReport:
        """Run this node's ranks of the case and put their files into the store under ``key``; the report."""
        case = task.case
        if task.swap_dir:
            Path(task.swap_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"zbench-node{self.rendezvous.node_rank}-") as tmp:
            files = CaseFiles(Path(tmp))
            files.task.write_text(task.model_dump_json())
            ranks = LocalRanks(
                files, world_size=case.world_size, device=case.device, run_id=run_id, rdzv=self.rendezvous
            )
            timed_out = watch(ranks, case.timeout_s, lambda: None)
            return NodeReport(
                node_rank=self.rendezvous.node_rank,
                failures=ranks.result.failures,
                pids=ranks.pids,
                timed_out=timed_out,
                error=ranks.result.error,
                files=[
                    self._send(path, f"{key}/file{index}")
                    for index, path in enumerate(p for p in sorted(Path(tmp).iterdir()) if _worth_sending(p, files))
                ],
            )

    def _send(self, path: Path, key: str) -> SentFile:
        data = path.read_bytes()
        if path.suffix == ".log":
            data = data[-LOG_BYTES_SENT:]
        chunks = max(1, -(-len(data) // CHUNK_BYTES))
        for chunk in range(chunks):
            piece = data[chunk * CHUNK_BYTES : (chunk + 1) * CHUNK_BYTES]
            self.store.set(f"{key}/{chunk}", piece)  # type: ignore[arg-type]  # the stub says str; bytes pass as is
        return SentFile(name=path.name, chunks=chunks, mtime_ns=path.stat().st_mtime_ns)


def _worth_sending(path: Path, files: CaseFiles) -> bool:
    ranks_own = path.name.startswith(("rank", "profile-rank"))  # CaseFiles' result, error, log and profile
    return path.is_file() and path != files.task and (ranks_own or path == files.params)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
