"""What ``zbench calibrate`` measured on a machine, kept in the cluster profile it writes (``calibration:``).

The profile's scalar figures (``peak_tflops``, the links, ``pcie_gb_s``...) are what today's step-time model
reads; they are derived from these tables (``zbench.plan.calibrate.profile``). The tables themselves are kept
whole, curves included, so that a finer model can charge each operator and each collective its own measured
time without calibrating again, and so that two calibrations can be compared figure by figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MatmulPoint(_Frozen):
    """One matrix product ``(m x k) @ (k x n)`` in ``dtype``: its median throughput."""

    m: int = Field(gt=0)
    k: int = Field(gt=0)
    n: int = Field(gt=0)
    dtype: str
    tflops: float = Field(gt=0)


class BandwidthPoint(_Frozen):
    """A memory-bound operator (``copy``: read + write; ``add``: two reads + a write) over ``bytes`` of input."""

    op: str
    bytes: int = Field(gt=0)
    gb_s: float = Field(gt=0, description="bytes moved (read + written) per second, 10^9")


class CollectiveCurve(_Frozen):
    """One collective's time against message size over ``ranks`` ranks, and the alpha-beta fit of it.

    ``points`` are ``[bytes, seconds]`` with bytes counted as the ledger counts them (an all-gather its output,
    a reduce-scatter its input, an all-reduce twice its buffer), so the fit's bandwidth is the bus bandwidth
    ``zbench.plan.simulate.step.collective_seconds`` takes: ``seconds = latency + (ranks-1)/ranks * bytes /
    bandwidth`` (broadcast: ``bytes / bandwidth``).
    """

    op: str
    ranks: int = Field(ge=2)
    latency_us: float = Field(ge=0, description="the fit's intercept: one call's fixed cost")
    bandwidth_gb_s: float = Field(gt=0, description="the fit's bus bandwidth, 10^9 bytes/s")
    fit_error: float = Field(ge=0, description="median relative error of the fit over the points")
    points: list[tuple[int, float]]


class DiskProbe(_Frozen):
    directory: str
    write_gb_s: float = Field(gt=0, description="sequential write of a file, fsync included")
    read_gb_s: float = Field(gt=0, description="sequential read of that file after evicting it from the page cache")
    cache_evicted: bool = Field(description="whether the page cache could be told to drop the file before reading")


def dtype_name(dtype: torch.dtype) -> str:
    """How a calibration names a dtype in its tables and keys (``float32``, ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def factor_key(op: str, dtype: str) -> str:
    """How ``Calibration.operator_factors`` names an operator's factor in a reduced precision: ``addmm:bfloat16``
    (an operator's fp32 factor goes by its name alone, so profiles from before dtypes were probed keep loading)."""
    return op if dtype == "float32" else f"{op}:{dtype}"


def is_dtype_factor(key: str) -> bool:
    """Whether an ``operator_factors`` key is a reduced precision's own (``factor_key``)."""
    return ":" in key


def overhead_key(implementation: str, stage: int) -> str:
    """How ``Calibration.overheads`` names one implementation at one stage: ``fsdp-s3``."""
    return f"{implementation}-s{stage}"


class ImplementationOverhead(_Frozen):
    """One implementation's host work per step beyond its operators (``zbench.plan.calibrate.overheads``)."""

    per_step_us: float
    per_block_us: float
    per_element_us: float = Field(
        default=0.0,
        description="host work per parameter element beyond DDP's, from the wide probe (DDP's own: 0 by definition; "
        "profiles before schema 6: 0)",
    )
    residuals_us: dict[str, float] = Field(description="the measured residual at each probed depth (blocks)")
    measured_us: dict[str, float] = Field(
        default_factory=dict,
        description="each probe's measured median step, by depth at the narrow width and 'DxW' for the wide probe "
        "(operators and host work together; profiles before schema 4: not kept)",
    )


class Calibration(_Frozen):
    """Everything one ``zbench calibrate`` run measured, with where and when."""

    measured_at: str = Field(description="UTC, ISO 8601")
    host: str
    torch: str
    zbench: str
    device: str = Field(description="the device the figures are for: a GPU's name, or 'cpu'")
    backend: str
    ranks: int = Field(ge=1, description="processes the collectives ran over (1: none measured)")
    threads_per_rank: int = Field(ge=1)
    seconds: float = Field(ge=0, description="how long the calibration took")
    matmul: list[MatmulPoint]
    memory_bound: list[BandwidthPoint]
    collectives: list[CollectiveCurve]
    collective_issue_us: float | None = Field(
        default=None, ge=0, description="host time to issue one asynchronous collective (none at one rank)"
    )
    hook_call_us: float = Field(ge=0, description="cost of one module forward hook per call")
    op_call_us: float | None = Field(
        default=None, ge=0, description="cost of one operator of negligible work inside a training step, host time"
    )
    copies_gb_s: dict[str, float] = Field(
        description="host <-> device copies (h2d/d2h, pinned/pageable); on a CPU a host memory copy"
    )
    disk: DiskProbe | None = None
    host_adam_params_per_s: float = Field(gt=0)
    mapped_gb_s: float | None = Field(
        default=None,
        gt=0,
        description="on a CPU: bytes per second of a large fresh tensor's mapping, page faults and unmapping, as "
        "zbench's CPU ranks pay them (glibc's mmap threshold pinned: zbench.measure.memory); none on a GPU, whose "
        "caching allocator reuses blocks",
    )
    thread_speedup: float | None = Field(
        default=None,
        gt=0,
        description="profiles before schema 8, on a CPU: a transformer MLP's fp32 training step on every core's "
        "threads against one thread, for every dtype (thread_speedups replaces it)",
    )
    thread_speedups: dict[str, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="on a CPU: {dtype: [[charged s, speed-up], ...]}, each in-step probe's step on every core's "
        "threads against one thread (a world-1 rank has them all), by the probe's charge at one thread; none on a "
        "GPU or one core",
    )
    corun_slowdowns: dict[str, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="on a CPU: {dtype: [[charged s, slow-down], ...]}, each in-step probe's one-thread step while "
        "sibling processes ran it on every other core against the step alone (a rank whose world fills the cores "
        "runs beside the others), by the probe's charge at one thread; none on a GPU, one core, or profiles before "
        "schema 9 (no slow-down)",
    )
    overheads: dict[str, ImplementationOverhead] = Field(
        default_factory=dict,
        description="on a CPU: each built-in's step beyond its operators, by '<implementation>-s<stage>'",
    )
    step_residuals: dict[str, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="on a CPU: a probe model's whole training step, timed without the profiler, over what the "
        "operator model charges it (its operators at their factors and per-call cost), by the probe step's dtype, "
        "as [charged seconds, residual] by charged seconds (zbench.plan.calibrate.in_step.step_residuals): the "
        "step's time outside the operators the ledger records; profiles before schema 7: none, residual 1",
    )
    operator_factors: dict[str, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="on a CPU: each operator's time inside a profiled training step over what the tables charge "
        "it, as [size per call (FLOPs, else bytes moved), factor] by size, one point per call shape timed (profiles "
        "of 2026-11-30 and before: one per probe model, at its calls' mean size; zbench.plan.calibrate.in_step; "
        "'<op>:<dtype>' for an operator probed under autocast, which older profiles lack: the fp32 factor then; "
        "profiles before schema 5: none, every factor 1)",
    )
