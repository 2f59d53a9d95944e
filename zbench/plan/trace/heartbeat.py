"""A heartbeat for long traces: one line every few seconds saying what the trace is doing and for how long.

Note: tracing a 70B model at 1,024 ranks runs for minutes per implementation
with nothing else to print; a user (or a CI log) must be able to tell a slow
trace from a hung one. The heartbeat runs in a daemon thread and only reads
the phase the tracer last set, so it costs the trace nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from types import TracebackType

#: Seconds between two heartbeat lines unless ``$ZBENCH_HEARTBEAT_S`` says otherwise.
DEFAULT_EVERY_S = 15.0


def heartbeat_interval() -> float:
    """``$ZBENCH_HEARTBEAT_S`` when set to a positive number, else :data:`DEFAULT_EVERY_S`."""
    try:
        value = float(os.environ.get("ZBENCH_HEARTBEAT_S", DEFAULT_EVERY_S))
    except ValueError:
        return DEFAULT_EVERY_S
    return value if value > 0 else DEFAULT_EVERY_S


class Heartbeat:
    """Says ``<label>: <phase> (<seconds> s)`` through ``say`` every ``every_s`` seconds until closed."""

    def __init__(self, say: Callable[[str], None], *, every_s: float | None = None) -> None:
        self._say = say
        self._every_s = every_s if every_s is not None else heartbeat_interval()
        self._label = ""
        self._phase = "starting"
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="zbench-heartbeat", daemon=True)

    def task(self, label: str) -> None:
        """A new unit of work (one traced implementation): its clock starts now."""
        self._label, self._phase, self._started = label, "starting", time.monotonic()

    def phase(self, phase: str) -> None:
        """What the current task does now, e.g. ``step 2 of 3``."""
        self._phase = phase

    def _beat(self) -> None:
        while not self._stop.wait(self._every_s):
            elapsed = time.monotonic() - self._started
            self._say(f"  {self._label}: {self._phase} ({elapsed:.0f} s)")

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
