"""What the launcher and a case's ranks hand each other through the case's work directory, declared once.

The launcher writes ``case.json`` (a ``WorkerTask``) and starts every rank as
``python -m zbench.worker WORKDIR`` or forks it from the fork server
(``zbench.launch.forkserver``). Each rank writes ``rank<R>.pid`` first, then ``rank<R>.json`` (a
``RankResult``) or ``rank<R>.error.json`` (a ``RankError``) and its output to
``rank<R>.log``; rank 0 also writes ``params.pt`` (the final parameters) and
``progress`` (the step it is on). With the suite's ``profile`` key each rank
also writes ``profile-rank<R>.json`` (a Chrome trace of the profiled steps).
Every file is written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from zbench.cases.case import Case
from zbench.results.record import SCHEMA_VERSION, NvmlSummary, PairedTiming, PhaseTimes, RankMemory, StateBytes


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION


class WorkerTask(_Message):
    """The case to train and, for NVMe offload, the case's private swap directory (the engine's ``nvme_dir``)."""

    case: Case
    swap_dir: str | None = None


class CollectiveEntry(BaseModel):
    """One ledger row for one step: a collective kind and dtype, how often, how much (see ``zbench.measure.comms``)."""

    op: str
    dtype: str
    count: int
    elements: int
    bytes: int


class ProbeResult(_Message):
    """One rank's fp32 probe of a bf16 case (``Case.fp32_probe``): what the fp32 verdict needs."""

    losses: list[float]
    grad_norms: list[float | None]
    param_checksum: str
    seconds: float


class RankResult(_Message):
    """What one rank measured, for the harness to turn into the case's record."""

    rank: int
    losses: list[float]
    step_times_s: list[float]
    metrics: list[dict[str, float]]
    comms: list[list[CollectiveEntry]]
    phases: list[PhaseTimes]
    clock: str
    bus_bandwidth_bytes_per_s: float | None
    expected_comm_elements: int
    memory: RankMemory
    state_bytes: StateBytes
    nvml: NvmlSummary
    gpu_name: str | None
    parameters: int
    param_checksum: str
    """Hash of this rank's final full parameters: every rank must hold the same model."""
    paired: PairedTiming = PairedTiming(skipped="not measured")
    probe: ProbeResult | None = None
    """The fp32 probe's run, when the case has one."""


class RankError(_Message):
    rank: int
    kind: Literal["oom", "error"]
    message: str
    traceback: str = ""


class CaseFiles:
    """The paths inside one launch attempt's work directory: the only place their names are spelled."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)

    @property
    def task(self) -> Path:
        return self.workdir / "case.json"

    @property
    def progress(self) -> Path:
        return self.workdir / "progress"

    @property
    def params(self) -> Path:
        return self.workdir / "params.pt"

    @property
    def probe_params(self) -> Path:
        """Rank 0's gather of the fp32 probe's final parameters."""
        return self.workdir / "probe-params.pt"

    def result(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.json"

    def error(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.error.json"

    def log(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.log"

    def pid(self, rank: int) -> Path:
        """The rank's process id, written first thing: how the launcher finds a forked rank to signal."""
        return self.workdir / f"rank{rank}.pid"

    def exit_code(self, rank: int) -> Path:
        """How a forked rank ended when that was not a clean exit (an exit code, or minus the signal that killed
        it), written by the process that waited on it (``zbench.rank.worker.forked``)."""
        return self.workdir / f"rank{rank}.exit"

    def exit_codes(self) -> dict[int, int]:
        """The forked ranks' exit codes written so far (rank -> code), the first to end first."""
        return self._numbers_by_rank("exit")

    def rank_pids(self) -> set[int]:
        """The process ids the ranks have written so far."""
        return set(self._numbers_by_rank("pid").values())

    def _numbers_by_rank(self, suffix: str) -> dict[int, int]:
        """The number in each ``rank<R>.<suffix>`` written so far (rank -> number), the oldest file first."""
        found = []
        for path in self.workdir.glob(f"rank*.{suffix}"):
            try:
                found.append((path.stat().st_mtime_ns, int(path.name[4 : -len(suffix) - 1]), int(path.read_text())))
            except (OSError, ValueError):  # gone with its directory, or being written
                continue
        return {rank: number for _, rank, number in sorted(found)}

    def profile(self, rank: int) -> Path:
        return self.workdir / f"profile-rank{rank}.json"

    def profiles(self, world: int) -> list[Path]:
        """The ranks' profiler traces that are present (a rank that failed before writing its own has none)."""
        return [path for path in map(self.profile, range(world)) if path.exists()]

    def read_progress(self) -> str | None:
        try:
            return self.progress.read_text()
        except FileNotFoundError:
            return None
