"""What the ranks of a case handed back, turned into the case's stored record.

Per step: the loss averaged over ranks, the slowest rank's time, rank 0's phase
split and engine metrics. Per case: step-time statistics, peak memory, model
state by category and location next to the formulas, communication next to
theory, throughput, energy and time to target.
"""

from __future__ import annotations

import statistics

import torch

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.formulas import placement_for
from zbench.cases.model_source import model_info, parameter_sizes
from zbench.launch.handoff import RankResult
from zbench.launch.launcher import Outcome
from zbench.measure.comms import theory_elements as comm_theory
from zbench.measure.flops import derived
from zbench.measure.timing import summarize
from zbench.results.record import (
    CaseRecord,
    CommSummary,
    EnergySummary,
    Fp32Probe,
    LocationTotal,
    MemorySummary,
    ModelState,
    NvmlSummary,
    OpVolume,
    PairedTiming,
    PhaseSummary,
    PhaseTimes,
    StepSample,
    StepTimeSummary,
    Throughput,
    TimeToTarget,
)
from zbench.values import CATEGORIES, LOCATIONS


def skipped_record(case: Case) -> CaseRecord:
    return CaseRecord(config=case, status="skipped", skip_reason=case.skip_reason)


def failed_record(
    case: Case, error: str, *, stderr_tail: str = "", started_at: str | None = None, ended_at: str | None = None
) -> CaseRecord:
    """A case the harness could not run to the end for a reason of its own (not a rank's failure)."""
    return CaseRecord(
        config=case, status="error", error=error, stderr_tail=stderr_tail, started_at=started_at, ended_at=ended_at
    )


def case_record(case: Case, outcome: Outcome, *, started_at: str, ended_at: str) -> CaseRecord:
    record = CaseRecord(
        config=case,
        status=outcome.status,
        error=outcome.error,
        stderr_tail=outcome.stderr_tail if outcome.status != "ok" or outcome.warnings else "",
        exit_codes=outcome.exit_codes,
        rank_pids=outcome.pids,
        warnings=outcome.warnings,
        started_at=started_at,
        ended_at=ended_at,
        wall_s=outcome.wall_s,
    )
    if outcome.status != "ok":
        return record
    return measured(record, sorted(outcome.ranks, key=lambda r: r.rank))


def measured(record: CaseRecord, ranks: list[RankResult]) -> CaseRecord:
    """``record`` with every figure derived from its ranks' results."""
    case = record.config
    steps = [
        StepSample(
            step=i,
            loss=sum(r.losses[i] for r in ranks) / len(ranks),
            step_time_s=max(r.step_times_s[i] for r in ranks),
            warmup=i < case.warmup_steps,
            profiled=i in case.profile_steps,
            **ranks[0].phases[i].model_dump(),
            metrics=ranks[0].metrics[i],
        )
        for i in range(case.steps)
    ]
    stats = summarize([s.step_time_s for s in steps if s.timed])
    median = stats["median"]
    tokens = case.tokens_per_step
    params = ranks[0].parameters
    comms = comm_summary(case, ranks, params)
    phases = phase_summary(steps, ranks[0].clock)
    comms.comm_to_compute = comm_to_compute(comms, phases)
    gpu_name = ranks[0].gpu_name
    return record.model_copy(
        update={
            "param_checksums": [r.param_checksum for r in ranks],
            "throughput": Throughput(
                **derived(
                    model_info(case.model),
                    seq=case.seq_len,  # the suite's, which may be shorter than the preset's context
                    tokens_per_step=tokens,
                    step_time_s=median,
                    world=case.world_size,
                    precision=case.precision,
                    gpu_name=gpu_name,
                ),
                gpu_name=gpu_name,
            )
            if median
            else None,
            "energy": energy_summary([r.nvml for r in ranks], case.timed_steps, tokens),
            "time_to_target": time_to_target(steps, case.target_loss),
            "model_parameters": params,
            "steps": steps,
            "summary": StepTimeSummary(
                step_time_median_s=median,
                step_time_iqr_s=stats["iqr"],
                step_time_q1_s=stats["q1"],
                step_time_q3_s=stats["q3"],
                tokens_per_s=tokens / median if median else None,
                tokens_per_s_per_rank=tokens / median / case.world_size if median else None,
                final_loss=steps[-1].loss,
            ),
            "memory": MemorySummary(
                kind=ranks[0].memory.kind,
                peak_bytes=max(r.memory.bytes for r in ranks),
                per_rank=[r.memory for r in ranks],
            ),
            "model_state": model_state(case, ranks),
            "paired": paired_timing(ranks),
            "probe": fp32_probe(ranks),
            "comms": comms,
            "phases": phases,
        }
    )


def fp32_probe(ranks: list[RankResult]) -> Fp32Probe | None:
    """The fp32 probe's run as the case's steps are: losses averaged over ranks, rank 0's gradient norms, the
    slowest rank's time."""
    probes = [r.probe for r in ranks]
    if any(p is None for p in probes):
        return None
    runs = [p for p in probes if p is not None]
    return Fp32Probe(
        losses=[sum(step) / len(step) for step in zip(*(p.losses for p in runs), strict=True)],
        grad_norms=runs[0].grad_norms,
        param_checksums=[p.param_checksum for p in runs],
        seconds=max(p.seconds for p in runs),
    )


def paired_timing(ranks: list[RankResult]) -> PairedTiming:
    """Each round's slowest rank, as for the training steps (every rank times the same rounds)."""
    skipped = next((r.paired for r in ranks if r.paired.skipped or not r.paired.case_s), None)
    if skipped is not None:
        return skipped
    if len({len(r.paired.case_s) for r in ranks}) > 1:
        return PairedTiming(skipped="the ranks timed different numbers of paired rounds")
    return PairedTiming(
        case_s=[max(vals) for vals in zip(*(r.paired.case_s for r in ranks), strict=True)],
        reference_s=[max(vals) for vals in zip(*(r.paired.reference_s for r in ranks), strict=True)],
    )


def comm_summary(case: Case, ranks: list[RankResult], params: int) -> CommSummary:
    """Per step and rank: collectives by kind, their logical volume, and theory (docs/methods.md)."""
    timed = range(case.warmup_steps, case.steps)
    busiest = max(ranks, key=lambda r: sum(e.elements for i in timed for e in r.comms[i]))
    per_step = [sum(e.elements for e in busiest.comms[i]) for i in timed]
    median = sorted(per_step)[len(per_step) // 2] if per_step else 0
    by_op: dict[str, OpVolume] = {}
    for e in busiest.comms[timed[-1]] if timed else []:
        slot = by_op.setdefault(f"{e.op} ({e.dtype})", OpVolume(count=0, elements=0, bytes=0))
        slot.count, slot.elements, slot.bytes = slot.count + e.count, slot.elements + e.elements, slot.bytes + e.bytes
    expected = ranks[0].expected_comm_elements
    bytes_per_step = sum(v.bytes for v in by_op.values())
    bandwidth = min((r.bus_bandwidth_bytes_per_s for r in ranks if r.bus_bandwidth_bytes_per_s), default=None)
    return CommSummary(
        elements_per_step=median,
        bytes_per_step=bytes_per_step,
        per_step_elements=per_step,
        by_op=by_op,
        expected_elements=expected,
        design_elements=comm_theory(params, case.stage),
        error_rel=(median - expected) / expected if expected else None,
        bus_bandwidth_bytes_per_s=bandwidth,
        est_time_s=bytes_per_step / bandwidth if bandwidth else None,
    )


def phase_summary(steps: list[StepSample], clock: str) -> PhaseSummary:
    """Median forward / backward / optimizer seconds over the timed steps (rank 0, see zbench.measure.phases)."""
    timed = [s for s in steps if s.timed]

    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    return PhaseSummary(
        clock=clock, **{phase: median([getattr(s, phase) for s in timed]) for phase in PhaseTimes.model_fields}
    )


def comm_to_compute(comms: CommSummary, phases: PhaseSummary) -> float | None:
    """Estimated communication time per step (volume / probed bandwidth) over forward + backward time."""
    compute = (phases.forward_s or 0.0) + (phases.backward_s or 0.0)
    return comms.est_time_s / compute if comms.est_time_s is not None and compute > 0 else None


def energy_summary(nvml: list[NvmlSummary], timed_steps: int, tokens_per_step: int) -> EnergySummary:
    """nvml figures per rank; energy per step and per token over the timed steps, summed over ranks (all GPUs)."""
    if not all(n.available for n in nvml):
        return EnergySummary(available=False, reason=next((n.reason for n in nvml if not n.available), ""))
    energy = [n.energy_j for n in nvml]
    timed = [n.energy_timed_j for n in nvml]
    total = sum(e for e in energy if e is not None) if all(e is not None for e in energy) else None
    timed_total = sum(e for e in timed if e is not None) if all(e is not None for e in timed) else None
    return EnergySummary(
        available=True,
        per_rank=nvml,
        peak_used_bytes=max(n.peak_used_bytes or 0 for n in nvml),
        energy_j=total,
        energy_timed_j=timed_total,
        energy_per_step_j=timed_total / timed_steps if timed_total is not None else None,
        energy_per_token_j=timed_total / (timed_steps * tokens_per_step) if timed_total is not None else None,
    )


def time_to_target(steps: list[StepSample], target: float | None) -> TimeToTarget | None:
    """The first step whose loss reached the suite's ``target_loss``, and the training time until then."""
    if target is None:
        return None
    for s in steps:
        if s.loss <= target:
            return TimeToTarget(
                target_loss=target,
                reached=True,
                steps=s.step + 1,
                seconds=sum(x.step_time_s for x in steps[: s.step + 1]),
            )
    return TimeToTarget(target_loss=target, reached=False)


def declared_layout(case: Case) -> tuple[dict[str, dict[str, float]], str]:
    """The bytes ``case``'s implementation says it holds (its ``state_layout``) when it declares them, else the
    ZeRO formulas' placement; and which of the two it is."""
    declare = getattr(registry.resolve(case.implementation), "state_layout", None)
    spec = case.train_spec(torch.device(case.device))
    declared = declare(spec, parameter_sizes(case.model), case.world_size) if declare is not None else None
    if declared is not None:
        return declared, f"{case.implementation}'s own layout"
    caps = case.capabilities
    by_rows = caps is not None and caps.shards_parameters_by_rows
    return placement_for(case), "ZeRO formulas, each parameter split by rows" if by_rows else "ZeRO formulas"


def model_state(case: Case, ranks: list[RankResult]) -> ModelState:
    """Measured bytes (the fullest rank) by category and location next to the expected placement: the layout its
    implementation declares, else the ZeRO formulas' (docs/methods.md)."""
    per_rank = [r.state_bytes for r in ranks]
    fullest = max(per_rank, key=lambda s: sum(sum(v.values()) for v in s.values()))
    measured = {c: {loc: fullest.get(c, {}).get(loc, 0) for loc in LOCATIONS} for c in CATEGORIES}
    predicted, layout = declared_layout(case)
    by_location = {}
    for loc in LOCATIONS:
        m, p = sum(measured[c][loc] for c in CATEGORIES), sum(predicted[c][loc] for c in CATEGORIES)
        by_location[loc] = LocationTotal(measured=m, predicted=p, error_rel=(m - p) / p if p else None)
    measured_total = sum(v.measured for v in by_location.values())
    expected_total = sum(v.predicted for v in by_location.values())
    return ModelState(
        measured=measured,
        predicted=predicted,
        by_location=by_location,
        expected={c: sum(predicted[c].values()) for c in CATEGORIES},
        per_rank=per_rank,
        measured_total=measured_total,
        expected_total=expected_total,
        error_rel=(measured_total - expected_total) / expected_total if expected_total else None,
        layout=layout,
        unused_parameters=model_info(case.model).unused_parameters,
    )
