"""The processes that trace a search's setups: one per usable core, started once for a whole ``zbench tune`` and
kept across its rounds.

A fake trace runs Python on one core, so a search spreads its traces over processes. A search traces in rounds
(each micro-batch, then each option: seven rounds for gpt-70b on 64 GPUs), and a new process pays ~4 s importing
torch and zbench before its first trace. A pool per round paid that, and a second to shut down, in every round;
one pool for the search pays it once, at the first round that has anything to trace (a question answered from
the cache starts none).
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType

from zbench.cases.case import Case
from zbench.depth import split_depth
from zbench.errors import OneLineError
from zbench.plan.trace.plan import TracedRow, trace_plan


class Tracers:
    """A context: ``trace`` spreads traces over one process per usable core (in this process when there is one core,
    or one trace and no process started yet), the same processes for every call until the context ends.

    A process that dies loses only the trace it was running: every finished trace has been handed to ``done``
    (the cache keeps it) and the failure is one line."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or len(os.sched_getaffinity(0))
        self._pool: ProcessPoolExecutor | None = None
        self._took: dict[tuple, float] = {}

    def _expected_seconds(self, job: Case) -> tuple[float, int]:
        """How long ``job`` should take, to start the longest first (a round ends with its shortest traces, not with
        one process running a long one alone): the last trace of its kind in this search, unknown first; then the
        deeper cut first."""
        return self._took.get(_kind(job), math.inf), split_depth(job.model)[1] or 0

    def __enter__(self) -> Tracers:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def trace(
        self, jobs: list[Case], *, progress: Callable[[str], None], done: Callable[[Case, TracedRow], None]
    ) -> list[TracedRow]:
        """``trace_plan`` of each of ``jobs``, in their order; ``done`` hears each trace as it finishes."""
        if self.workers < 2 or (self._pool is None and len(jobs) < 2):  # not worth ~4 s of a process's imports
            in_order = trace_plan(jobs, device=jobs[0].device, progress=progress)
            for job, row in zip(jobs, in_order, strict=True):
                done(job, row)
            return in_order
        if self._pool is None:
            progress(f"tracing in {self.workers} processes, kept for the whole search")
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_import_tracer
            )
        rows: dict[int, TracedRow] = {}
        order = sorted(range(len(jobs)), key=lambda i: self._expected_seconds(jobs[i]), reverse=True)
        try:
            futures = {self._pool.submit(_trace_one, jobs[i], n, len(jobs)): i for n, i in enumerate(order)}
            for future in as_completed(futures):
                i = futures[future]
                rows[i] = future.result()
                self._took[_kind(jobs[i])] = rows[i].trace.seconds
                done(jobs[i], rows[i])
        except BrokenProcessPool:
            raise OneLineError(
                f"a tracing process died ({len(rows)} of {len(jobs)} traces finished and are cached; out of memory? "
                "run again to trace the rest)"
            ) from None
        return [rows[i] for i in range(len(jobs))]


def _kind(job: Case) -> tuple:
    """What sets a trace's time, apart from its micro-batch and cut: the code it runs (FSDP2's traces of a 70B cut
    took 3.4 s, ZeRO-3's 1.9 s)."""
    return job.implementation, job.stage, job.offload, job.activation_checkpointing


def _import_tracer() -> None:
    """A process's first work: what every trace needs imported (torch among it), then kept out of the cycle
    collector's sight (``gc.freeze``). A trace collects cycles before each step (``cycles_collected_between_steps``)
    and each full collection walked every object the imports made: 0.21 s a collection, 0.04 s frozen (gpt-70b cut
    to 6 blocks under FSDP2, 2026-11-28), two a trace; the traced figures are the same."""
    _exit_with_parent()
    import zbench.plan.trace.tracer  # noqa: F401

    gc.collect()
    gc.freeze()


def _exit_with_parent() -> None:
    """End this process when the one that started it dies.

    Note: a ``zbench tune`` killed (a ``timeout``, a cancelled CI job: SIGTERM or SIGKILL) cannot shut its pool
    down, and its tracing processes went on tracing the setups they held, minutes of both cores at 70B with the
    NVMe offload's sub-groups (then 1 MiB), with nobody to hear the answer (seen 2026-11-29: two for 24 minutes)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the parent's end of the pipe closes: it exited, however it died
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _trace_one(job: Case, index: int, total: int) -> TracedRow:
    """One job in a worker process, its progress on stderr."""

    def say(line: str) -> None:
        print(f"[{index + 1}/{total}] {line.strip().removeprefix('[1/1] ')}", file=sys.stderr, flush=True)

    (row,) = trace_plan([job], device=job.device, progress=say)
    return row
