"""The stored case record: one typed object from the runner to the store, the gate and the report.

``CaseRecord`` is what ``results/<run-id>/cases/<case-id>.json`` holds. Every
reader (equivalence, ``zbench check``, ``compare``, history, the report, the
pandas loaders) goes through it, so a field has one name and one type
everywhere; ``summary_row()`` is the one flat projection every table uses.

Files written before schema 2 are upgraded on load by ``migrate`` (tested on a
stored schema-1 run in ``tests/fixtures``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from zbench.cases.case import Case
from zbench.values import FAILED_STATUSES, Status

SCHEMA_VERSION = 2

StateBytes = dict[str, dict[str, int]]
"""``{category: {location: bytes}}`` (``zbench.values.CATEGORIES`` x ``LOCATIONS``)."""


class _Part(BaseModel):
    """A piece of a stored record: validated on load, unknown keys from newer writers ignored."""

    model_config = ConfigDict(extra="ignore")


class PhaseTimes(_Part):
    """Where a step's time went (``zbench.measure.phases``); ``None`` where the clock has no such mark."""

    device_step_s: float | None = None
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None


class StepSample(PhaseTimes):
    """One training step: the loss averaged over ranks, the slowest rank's time, rank 0's phase split."""

    step: int
    loss: float
    step_time_s: float
    warmup: bool
    metrics: dict[str, float] = Field(default_factory=dict)
    """What the engine reported after the step (e.g. ``loss_scale``)."""
    profiled: bool = False
    """Ran under torch.profiler (the suite's ``profile.steps``): its time carries the profiler's overhead."""

    @property
    def timed(self) -> bool:
        """Counts in the step-time statistics: neither a warm-up step nor a profiled one."""
        return not self.warmup and not self.profiled


class StepTimeSummary(_Part):
    """Statistics of the timed steps (``StepSample.timed``: after warm-up, not profiled)."""

    step_time_median_s: float | None = None
    step_time_iqr_s: float | None = None
    step_time_q1_s: float | None = None
    step_time_q3_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_rank: float | None = None
    final_loss: float | None = None


class RankMemory(_Part):
    """One rank's peak memory over the training steps (see ``zbench.measure.memory``)."""

    kind: str
    """``cuda_allocated`` (the CUDA allocator's peak) or ``rss`` (peak resident set on CPU)."""
    bytes: int
    rss_bytes: int | None = None
    since: str | None = None
    cuda_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


class MemorySummary(_Part):
    kind: str
    peak_bytes: int
    """The largest rank's peak: what must fit."""
    per_rank: list[RankMemory] = Field(default_factory=list)


class LocationTotal(_Part):
    measured: int
    predicted: float
    error_rel: float | None = None


class ModelState(_Part):
    """Model-state bytes of the fullest rank by category and location, next to the formulas' placement."""

    measured: StateBytes
    predicted: dict[str, dict[str, float]] = Field(default_factory=dict)
    by_location: dict[str, LocationTotal] = Field(default_factory=dict)
    expected: dict[str, float] = Field(default_factory=dict)
    per_rank: list[StateBytes] = Field(default_factory=list)
    measured_total: int
    expected_total: float
    error_rel: float | None = None
    layout: str = "ZeRO formulas"
    """Where ``predicted`` comes from: the ZeRO formulas, or the implementation's own declared layout."""
    unused_parameters: bool = False
    """The model may leave parameters without a gradient in a step (experts no token reached): an engine then
    holds fewer gradient bytes than the formulas say (none for such a parameter after the step), and no optimizer
    state for one that never had a gradient; never more."""


class OpVolume(_Part):
    count: int
    elements: int
    bytes: int


class CommSummary(_Part):
    """Collectives per step and rank (logical ring volume), next to theory (docs/methods.md)."""

    elements_per_step: int
    bytes_per_step: int
    per_step_elements: list[int] = Field(default_factory=list)
    by_op: dict[str, OpVolume] = Field(default_factory=dict)
    """``"all_reduce (float32)"`` -> volume in the last timed step."""
    expected_elements: int
    design_elements: int
    error_rel: float | None = None
    bus_bandwidth_bytes_per_s: float | None = None
    est_time_s: float | None = None
    comm_to_compute: float | None = None


class PhaseSummary(PhaseTimes):
    """Median forward / backward / optimizer seconds over the timed steps (rank 0)."""

    clock: str


class Throughput(_Part):
    model_flops_per_token: float | None = None
    tflops_per_rank: float | None = None
    peak_tflops: float | None = None
    mfu: float | None = None
    gpu_name: str | None = None


class NvmlSummary(_Part):
    """One rank's GPU as nvml saw it (``available`` False with the ``reason`` on CPU or without nvml)."""

    available: bool
    reason: str | None = None
    interval_s: float | None = None
    samples: int | None = None
    peak_used_bytes: int | None = None
    mean_utilization_pct: float | None = None
    mean_power_w: float | None = None
    energy_j: float | None = None
    energy_timed_j: float | None = None
    energy_source: str | None = None
    timeline: list[list[float]] = Field(default_factory=list)
    """``[seconds, used bytes, utilisation %, watts]`` rows, at most ~200."""


class EnergySummary(_Part):
    available: bool
    reason: str | None = None
    per_rank: list[NvmlSummary] = Field(default_factory=list)
    peak_used_bytes: int | None = None
    energy_j: float | None = None
    energy_timed_j: float | None = None
    energy_per_step_j: float | None = None
    energy_per_token_j: float | None = None


class TimeToTarget(_Part):
    target_loss: float
    reached: bool
    steps: int | None = None
    seconds: float | None = None


class PairedTiming(_Part):
    """Step times of the case and of a DDP copy of its model, taken in alternating rounds after training
    (``zbench.rank.paired``): the ratio cancels the machine's drift, and the regression gate judges by it."""

    case_s: list[float] = Field(default_factory=list)
    reference_s: list[float] = Field(default_factory=list)
    """Round ``i``'s DDP step, taken right before or after the case's step ``i`` (the order alternates)."""
    skipped: str | None = None
    """Why no rounds ran (the case is the reference, the suite asked for none, no room for the DDP copy)."""

    @property
    def ratios(self) -> list[float]:
        """The case's step over DDP's, round by round."""
        return [c / r for c, r in zip(self.case_s, self.reference_s, strict=True) if r > 0]

    @property
    def median_ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None


class Check(_Part):
    """One equivalence check: its figure, the bound it must stay within, the measured noise the bound came from."""

    name: Literal["loss", "grad_norm", "parameters", "ranks", "model_state"]
    passed: bool | None
    """``None``: the check could not run (``detail`` says why)."""
    figure: float | None = None
    bound: float | None = None
    noise: float | None = None
    """The noise twin's own figure (the bound is a multiple of it, docs/methods.md#equivalence)."""
    detail: str | None = None
    """Where the figure is: the step, the tensor, the ranks or the byte category."""
    probe: bool = False
    """Judged on the case's fp32 probe (``Case.fp32_probe``) against the fp32 reference and twin, with the fp32
    bounds; else on the case's own run."""

    @property
    def label(self) -> str:
        """The check's name as the verdict prints it: ``fp32 probe parameters`` for a probe's check."""
        return f"fp32 probe {self.name}" if self.probe else self.name

    @property
    def margin(self) -> float | None:
        """Figure over bound: above 1 fails; for a caught bug, how clearly."""
        if self.figure is None or not self.bound:
            return None
        return self.figure / self.bound


class Equivalence(_Part):
    """Does the case train like DDP? Every check (see ``zbench.verdicts.equivalence``), the verdict and why."""

    equivalent: bool
    reason: str | None = None
    reference_case: str | None = None
    twin_case: str | None = None
    """The noise twin whose distance from the reference set the bounds, if one ran."""
    checks: list[Check] = Field(default_factory=list)
    max_rel_loss_diff: float | None = None
    max_rel_param_diff: float | None = None
    """Model-wide ``||p - ref|| / ||ref||``."""
    worst_parameter: str | None = None
    worst_parameter_rel_diff: float | None = None
    tolerance_rel: float | None = None
    """Schema 2's single fixed tolerance (records before the measured-noise bounds)."""
    max_abs_loss_diff: float | None = None
    max_abs_param_diff: float | None = None

    @property
    def failed_checks(self) -> list[str]:
        return [c.label for c in self.checks if c.passed is False]


class SummaryRow(BaseModel):
    """One case in one flat row: what every table shows and what ``--json`` and ``store.load_cases`` emit."""

    case_id: str
    model: str
    implementation: str
    noise_twin: bool
    """The DDP reference's second run that measures its group's noise (docs/methods.md#equivalence)."""
    stage: int
    world_size: int
    precision: str
    offload: str
    device: str
    status: Status
    step_time_median_s: float | None
    step_time_iqr_s: float | None
    ratio_to_ddp: float | None
    tokens_per_s: float | None
    peak_memory_bytes: int | None
    model_state_bytes: int | None
    expected_model_state_bytes: float | None
    max_rel_loss_diff: float | None
    max_rel_param_diff: float | None
    equivalent: bool | None
    failed_checks: list[str]
    """The equivalence checks that failed (``loss``, ``grad_norm``, ``parameters``, ``ranks``, ``model_state``;
    ``fp32 probe loss`` ... for the checks of a bf16 case's fp32 probe)."""
    error: str | None
    cost_per_step: float | None = None
    """At the suite's ``price_per_gpu_hour``: every rank of the case for one median step."""
    cost_per_million_tokens: float | None = None


class Fp32Probe(_Part):
    """A bf16 (or fp16) case's fp32 probe: the same implementation, options and data trained again in fp32 by the
    same ranks (``Case.fp32_probe``), judged against the fp32 DDP reference with the fp32 bounds."""

    losses: list[float]
    """Per step, averaged over ranks."""
    grad_norms: list[float | None]
    """Per step, as rank 0's engine reported it (``None`` where it reports none)."""
    param_checksums: list[str]
    params_file: str | None = None
    """The probe's final parameters (relative to the run directory) until its verdict is stored."""
    seconds: float
    """Wall time of the probe on the slowest rank: build, train, gather (its cost to the case)."""


class CaseRecord(_Part):
    """A case as it ended: its configuration, status, every step, and the figures derived from them."""

    schema_version: int = SCHEMA_VERSION
    run_id: str | None = None
    config: Case
    status: Status
    skip_reason: str | None = None
    error: str | None = None
    stderr_tail: str = ""
    warnings: list[str] = Field(default_factory=list)
    exit_codes: list[int | None] = Field(default_factory=list)
    rank_pids: list[int] = Field(default_factory=list)
    started_at: str | None = None
    ended_at: str | None = None
    wall_s: float | None = None
    model_parameters: int | None = None
    steps: list[StepSample] = Field(default_factory=list)
    summary: StepTimeSummary = Field(default_factory=StepTimeSummary)
    memory: MemorySummary | None = None
    model_state: ModelState | None = None
    comms: CommSummary | None = None
    phases: PhaseSummary | None = None
    throughput: Throughput | None = None
    energy: EnergySummary | None = None
    time_to_target: TimeToTarget | None = None
    equivalence: Equivalence | None = None
    ratio_to_ddp: float | None = None
    """Step time over DDP's, same run: the median paired ratio when paired rounds ran, else the median step time
    over the DDP reference case's."""
    paired: PairedTiming | None = None
    """Rounds of this case's step and a DDP copy's, alternating: what the regression gate compares."""
    params_file: str | None = None
    """Final parameters (relative to the run directory) while they are kept; see ``Case.keep_params``."""
    probe_params_file: str | None = None
    """An fp32 DDP reference's or twin's parameters after ``config.probe_steps`` steps, what capped fp32 probes are
    judged against, kept as ``params_file`` is."""
    param_checksums: list[str] = Field(default_factory=list)
    """Each rank's hash of its final full parameters (they must all agree)."""
    probe: Fp32Probe | None = None
    """The fp32 probe's run, for a bf16 or fp16 case that had one (``Case.fp32_probe``)."""
    profile_traces: list[str] = Field(default_factory=list)
    """The ranks' torch.profiler Chrome traces of the suite's ``profile.steps``, relative to the run directory
    (``profiles/<case-id>/profile-rank<R>.json``), rank order; one per rank that wrote one."""

    @property
    def case_id(self) -> str:
        return self.config.case_id

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def equivalent(self) -> bool | None:
        return None if self.equivalence is None else self.equivalence.equivalent

    @property
    def failed(self) -> bool:
        """Did not run to the end, or ran and did not train like DDP."""
        return self.status in FAILED_STATUSES or (self.ok and not self.equivalent)

    @property
    def step_time_median_s(self) -> float | None:
        return self.summary.step_time_median_s

    @property
    def peak_bytes(self) -> int | None:
        return None if self.memory is None else self.memory.peak_bytes

    @property
    def model_state_bytes(self) -> int | None:
        return None if self.model_state is None else self.model_state.measured_total

    def timed_step_times(self) -> list[float]:
        """Every timed step's time (after warm-up, not profiled): the samples the regression gate tests."""
        return [s.step_time_s for s in self.steps if s.timed]

    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def summary_row(self) -> SummaryRow:
        """The flat per-case figures every table shows (compare, ``--json``, pandas, the console summary)."""
        c, eq, ms = self.config, self.equivalence, self.model_state
        return SummaryRow(
            case_id=self.case_id,
            noise_twin=c.noise_twin,
            model=c.model,
            implementation=c.implementation,
            stage=c.stage,
            world_size=c.world_size,
            precision=c.precision,
            offload=c.offload,
            device=c.device,
            status=self.status,
            step_time_median_s=self.step_time_median_s,
            step_time_iqr_s=self.summary.step_time_iqr_s,
            ratio_to_ddp=self.ratio_to_ddp,
            tokens_per_s=self.summary.tokens_per_s,
            peak_memory_bytes=self.peak_bytes,
            model_state_bytes=self.model_state_bytes,
            expected_model_state_bytes=None if ms is None else ms.expected_total,
            max_rel_loss_diff=None if eq is None else eq.max_rel_loss_diff,
            max_rel_param_diff=None if eq is None else eq.max_rel_param_diff,
            equivalent=self.equivalent,
            failed_checks=[] if eq is None else eq.failed_checks,
            error=self.error or self.skip_reason,
            cost_per_step=self.cost_per_step(),
            cost_per_million_tokens=self.cost_per_million_tokens(),
        )

    def cost_per_step(self, price_per_gpu_hour: float | None = None) -> float | None:
        """Every rank of the case for one median step, at ``price_per_gpu_hour`` (default: the suite's)."""
        price = price_per_gpu_hour or self.config.price_per_gpu_hour
        median = self.step_time_median_s
        return None if price is None or median is None else price * self.config.world_size * median / 3600

    def cost_per_million_tokens(self, price_per_gpu_hour: float | None = None) -> float | None:
        per_step = self.cost_per_step(price_per_gpu_hour)
        tokens = self.config.tokens_per_step
        return None if per_step is None or not tokens else per_step / tokens * 1e6

    def to_json_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        data["config"] = self.config.to_json_dict()
        return {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, "case_id": self.case_id, **data}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> CaseRecord:
        return cls.model_validate(migrate(data))

    @classmethod
    def read(cls, path: Path) -> CaseRecord:
        return cls.from_json_dict(json.loads(Path(path).read_text()))


_STEP_KEYS = tuple(StepSample.model_fields)


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Upgrade a stored record to the current schema (a no-op for current files).

    Schema 1 merged the engine's per-step metrics into each step's keys, stored
    options as a mapping with the case id inside the config, and had no
    capabilities; its other fields keep their names.
    """
    version = data.get("schema_version", 1)
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"record schema {version} is newer than this zbench understands ({SCHEMA_VERSION}); upgrade zbench"
        )
    if version == SCHEMA_VERSION:
        return data
    out = dict(data)
    out["steps"] = [
        {
            **{k: v for k, v in s.items() if k in _STEP_KEYS},
            "metrics": {k: v for k, v in s.items() if k not in _STEP_KEYS},
        }
        for s in data.get("steps") or []
    ]
    out["summary"] = data.get("summary") or {}
    out["schema_version"] = SCHEMA_VERSION
    return out
