"""torch.profiler traces of chosen training steps (the suite's ``profile: {steps: [...]}``), one file per rank.

Each chosen step is its own profiler session, opened and closed around that
step alone, so the steps in between run without a profiler attached. The
sessions' events share one clock (kineto's ``baseTimeNanoseconds``), so they
are merged into one Chrome trace, written atomically once training is over
(after the rank's peak memory is read).

Note: the first session in a process spends seconds setting kineto up; it is
paid outside the step's timed region, but a profiled step is still slower than
an unprofiled one, which is why the record flags it and the statistics skip it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from zbench.atomic import atomic_write_bytes


def activities(device: torch.device) -> list[ProfilerActivity]:
    """CPU operators always; the kernels too when the steps run on a GPU."""
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]


class StepProfiler:
    """Profiles ``steps`` of the training loop and writes them as one Chrome trace to ``path``."""

    def __init__(self, steps: list[int], device: torch.device, path: Path) -> None:
        self.steps = frozenset(steps)
        self.device = device
        self.path = Path(path)
        self._sessions: list[Path] = []

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run the body under the profiler when ``step`` is one of the chosen ones, else untouched.

        Note: each session goes to a scratch file right away (kineto exports only to files), so the rank does not
        hold the trace in memory while it trains: on CPU that would be counted in its peak resident set.
        """
        if step not in self.steps:
            yield
            return
        with profile(activities=activities(self.device)) as session:
            with record_function(f"zbench step {step}"):  # names the step in the merged trace
                yield
        scratch = self.path.with_name(f".{self.path.name}.step{step}.tmp")
        session.export_chrome_trace(str(scratch))
        self._sessions.append(scratch)

    def write(self) -> None:
        """The sessions merged into one trace, whole or not at all (nothing when no step was profiled)."""
        if not self._sessions:
            return
        trace = merged([json.loads(scratch.read_text()) for scratch in self._sessions])
        atomic_write_bytes(self.path, json.dumps(trace).encode())
        for scratch in self._sessions:
            scratch.unlink()


def merged(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace with every session's events, under the first session's header (they share one clock)."""
    return {**traces[0], "traceEvents": [event for trace in traces for event in trace["traceEvents"]]}
