"""Sibling processes that keep a CPU's other cores busy with the probe's own training step while one is timed.

A CPU run of ``world`` ranks on as many cores gives each rank a core of its own, and the step model charged such
a rank the speed of the calibration's lone one-thread step. It ran slower: on the 2-core machine's 48 runs of
2026-12-07 (docs/data/validate_simulator_1207c.json) the world-2 steps were predicted a median 7-34% short where
the same models' world-1 steps were 6-20% short, by a part that grew with the step, not a fixed cost. Two ranks
share what one rank had alone: the caches, the memory bus, the hypervisor's time for the second core. So the
calibration times its probe step once more with every other core running the same step (``Siblings``), and the
ratio of the two (``zbench.plan.calibrate.in_step.corun_slowdowns``) slows a rank whose world fills the cores
(``zbench.plan.simulate.compute.cpu_share``).

Processes, not threads: the step is Python and autograd as much as operators, and a thread would share the GIL.
Each sibling builds the probe model itself (the same seed, so the same shapes), runs its step on one thread from
the moment it is told to until it is told to stop, then finishes the step it is in and says so, so that the next
lone step is timed alone.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from zbench.errors import OneLineError

#: Seconds a sibling may take to build its probe model and run its first step (the width-1024 probe's fp32 step
#: took 2.4 s on the 2-core machine, 2026-12-07), or to finish the step it is in when told to stop.
REPLY_TIMEOUT_S = 120.0


#: What a sibling builds its step with: a module-level function (a spawned process imports it by name) of the
#: arguments ``Siblings.build`` passes, returning the step to run.
StepMaker = Callable[..., Callable[[], None]]


class Siblings:
    """``count`` processes, each running the step ``make_step`` builds on one thread while ``running()``'s block
    runs (the probe's: ``zbench.plan.calibrate.in_step.probe_step``).

    ``build`` before each probe model, ``wait_built`` before anything is timed alone; a context manager, so that
    the processes end however the probes do. No processes where ``count`` is 0 (a one-core host): ``running``
    then runs its block alone and ``active`` is False."""

    def __init__(self, count: int, make_step: StepMaker) -> None:
        context = multiprocessing.get_context("spawn")  # a fork would copy the caller's threads and allocator
        self._links: list[Connection] = []
        self._processes = []
        for _ in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_sibling, args=(theirs, make_step), daemon=True)
            process.start()
            theirs.close()
            self._links.append(ours)
            self._processes.append(process)

    @property
    def active(self) -> bool:
        return bool(self._links)

    def build(self, *args: Any) -> None:
        """Each sibling builds its step, ``make_step(*args)``, and runs it once, while the caller warms its own up
        (``wait_built`` waits for them)."""
        for link in self._links:
            link.send(("build", *args))

    def wait_built(self) -> None:
        self._replies("built")

    @contextmanager
    def running(self) -> Iterator[None]:
        """Every sibling steps throughout the block; on leaving it, each finishes its step before this returns."""
        for link in self._links:
            link.send(("run",))
        try:
            yield
        finally:
            for link in self._links:
                link.send(("stop",))
            self._replies("stopped")

    def _replies(self, expected: str) -> None:
        for link in self._links:
            if not link.poll(REPLY_TIMEOUT_S):
                raise OneLineError(f"a co-running probe process did not answer in {REPLY_TIMEOUT_S:.0f} s")
            reply = link.recv()
            if reply != expected:
                raise OneLineError(f"a co-running probe process failed: {reply}")

    def close(self) -> None:
        for link in self._links:
            try:
                link.send(("exit",))
            except OSError:  # it has already gone
                pass
            link.close()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self._links, self._processes = [], []

    def __enter__(self) -> Siblings:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _sibling(link: Connection, make_step: StepMaker) -> None:
    """A sibling's loop: build on ``build``, step from ``run`` until a ``stop`` arrives (checked between steps),
    leave on ``exit`` or when the caller has gone."""
    import torch

    torch.set_num_threads(1)
    step: Callable[[], None] | None = None
    while True:
        try:
            command, *args = link.recv()
        except EOFError:
            return
        try:
            if command == "build":
                step = make_step(*args)
                step()  # optimizer state, allocator caches
                link.send("built")
            elif command == "run" and step is not None:
                step()
                while not link.poll():
                    step()
                link.recv()  # the stop
                link.send("stopped")
            elif command == "exit":
                return
            else:
                link.send(f"unexpected command {command!r}")
        except Exception as error:  # the caller's error line names it; the sibling stays to be told to exit
            link.send(f"{type(error).__name__}: {error}")
