"""``zbench plan --simulate``: each traced case's step at every world size of a sweep, on one cluster profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zbench.cases.case import Case
from zbench.cases.model_source import model_info
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.compute import case_phase_seconds
from zbench.plan.simulate.step import StepEstimate, estimate
from zbench.plan.trace.plan import TracedRow

#: The sweep ``--simulate`` runs unless told: one node to 128 nodes of 8.
DEFAULT_SCALES = (8, 16, 32, 64, 128, 256, 512, 1024)

#: The step model's median error on a setup's step-time ratio to DDP's, on a calibrated CPU profile (below): the
#: larger of the two calibrations of the latest sitting (2026-12-07 16:36-17:30, a 2-core AMD EPYC: 3.5% and 2.7%,
#: _1207b; 2026-12-02 on the same kind of host, 3.4% and 3.9%, _1202; 2026-12-01 on an Intel Xeon with bf16, 3.8%
#: and 3.9%, _1201).
CALIBRATED_RATIO_ERROR = 0.035

#: What each compute model's predictions (``Cluster.compute_model``) measured against runs they were not fitted
#: to, shown beside them (docs/methods.md#simulation; each figure with its date, machines and data file).
MEASURED_ERROR = {
    "calibrated": "measured error on a calibrated CPU profile, this model (a factor per operator call shape inside a "
    "step, the probe steps' residual, host work timed paired with DDP's): one run of 64 cases (small and medium, "
    "worlds 1-2, fp32 with and without activation checkpointing; a 2-core AMD EPYC, 2026-12-02; "
    "docs/data/validate_simulator_1202.json), with the calibration before the runs / after them: step time median "
    "8.5% / 5.8%, worst 36% / 28%; ratio to DDP median 3.4% / 3.9%, worst 15.5% / 11.8%, Kendall tau 0.73 / 0.74 (the "
    "runs' two repeats order each other at tau 0.64); the same suite on the same kind of host on 2026-12-07 "
    "(docs/data/validate_simulator_1207b.json, calibrations 165 s before and 163 s after the runs, which ran slower "
    "than either): step median 8.8% / 14.8%, worst 26% / 34%, short in 53 / 64 of 64 cases; ratio median 3.5% / "
    "2.7%, worst 9.9% / 9.9%, tau 0.76 / 0.76 (repeats' tau 0.64); that morning's 64 runs re-predicted with two "
    "calibrations taken after them (_1207): step median 3.7% / 5.4%, worst 17% / 20%; ratio median 2.8% / 2.5%, worst "
    "9.8% / 9.7%, tau 0.81 / 0.85; that evening, tiny added and no checkpointing, 48 cases, three repeats with a "
    "calibration before, between and after them, each repeat predicted from the two around it (_1207c): step median "
    "13%, worst 44% (tiny, 8-54 ms steps, all short; small and medium within 19%), ratio median 4.1%, worst 25% "
    "(tiny, whose DDP twin read 1.15-1.18 against itself), tau 0.87 (repeats' 0.88); the same suite after calibrate "
    "began measuring the co-run slow-down (_1207d): step median 17%, worst 48% (small 16.5%, tiny 31%), ratio "
    "median 4.3%, worst 22%, tau 0.85. bf16 was not measured with it "
    "(that host "
    "emulates bf16); the model before, with bf16 (2026-12-01, a 2-core Intel Xeon, _1201): step median 15.2% / 12.7%, "
    "worst 49% / 44%, bf16 at medium world 1 over-predicted by 17-28%; ratio median 3.8% / 3.9%, worst 14.7% / 12.2%, "
    "tau 0.76 / 0.77",
    "datasheet": "measured error on datasheet operator rates: all 46 published FSDP runs (torchtitan, fms-fsdp, "
    "llm-foundry; 8-512 A100/H100) ran slower than predicted, by 7-45% (median 29%; 2026-11-27, "
    "docs/data/validate_published.json): read tokens/s as an upper bound",
    "efficiency": "measured error of FLOPs at an assumed efficiency: against the same 46 published runs, median "
    "|error| 26%, worst 70%, either sign (2026-11-27, docs/data/validate_published.json)",
}


@dataclass
class SimulatedRow:
    traced: TracedRow
    estimates: list[StepEstimate]

    @property
    def name(self) -> str:
        return self.traced.name

    def first_exposed(self) -> int | None:
        """The smallest world size of the sweep where forward or backward no longer hides its collectives."""
        return next((e.world for e in self.estimates if not e.hides_gathers), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "implementation": self.traced.case.implementation,
            "stage": self.traced.case.stage,
            "offload": self.traced.case.offload,
            "traced_at": self.traced.case.world_size,
            "error": self.traced.trace.error,
            "stops_hiding_at": self.first_exposed(),
            "estimates": [e.to_json() for e in self.estimates],
        }


def operator_compute(row: TracedRow, cluster: Cluster, world: int) -> dict[str, float] | None:
    """Compute per phase from the traced operators where the profile has operator rates (calibrated, or a
    datasheet's ``operators:``) and the trace has the operators."""
    rates = cluster.operator_rates()
    if rates is None or not row.trace.ops:
        return None
    return case_phase_seconds(row.trace.ops, rates, row.case, world=world)


def estimate_row(
    row: TracedRow,
    cluster: Cluster,
    world: int,
    phase_compute: dict[str, float] | None = None,
    *,
    serialized_phases: frozenset[str] | None = None,
) -> StepEstimate:
    """One traced case's step at ``world`` ranks; ``phase_compute`` replaces the row's own operators' charge
    (``operator_compute``) where the caller has it another way (``zbench.tune.extrapolate``), ``serialized_phases`` the
    phases its own options serialize (``serialized(row.case, cluster)``)."""
    case = row.case
    info = model_info(case.model)
    tokens = case.micro_batch * case.grad_accum * case.seq_len
    return estimate(
        as_issued(row.trace.phases, case, cluster),
        cluster=cluster,
        world=world,
        flops_per_step=info.flops_per_token(case.seq_len) * tokens,
        params=info.parameters,
        stage=case.stage,
        offload=case.offload,
        checkpointing=case.activation_checkpointing,
        tokens_per_step=tokens,
        phase_compute=phase_compute if phase_compute is not None else operator_compute(row, cluster, world),
        serialized=serialized(case, cluster) if serialized_phases is None else serialized_phases,
    )


def as_issued(phases: dict[str, dict[str, dict[str, int]]], case: Case, cluster: Cluster) -> dict[str, Any]:
    """The traced collectives as ``case``'s implementation issues them on the backend the profile was calibrated
    on: a reduce-scatter it builds from an in-place all-reduce there (``Capabilities.reduce_scatter_by_all_reduce``)
    becomes that all-reduce, at the ledger's bytes for one (twice the buffer, where a reduce-scatter counts it
    once). The trace runs on the fake backend, where every implementation issues the collective itself."""
    caps = case.capabilities
    if caps is None or cluster.backend() not in caps.reduce_scatter_by_all_reduce:
        return phases
    out = {}
    for phase, ops in phases.items():
        issued = dict(ops)
        if (scattered := issued.pop("reduce_scatter", None)) is not None:
            reduced = issued.get("all_reduce", {"count": 0, "bytes": 0})
            issued["all_reduce"] = {
                "count": reduced["count"] + scattered["count"],
                "bytes": reduced["bytes"] + 2 * scattered["bytes"],
            }
        out[phase] = issued
    return out


def serialized(case: Case, cluster: Cluster | None = None) -> frozenset[str]:
    """The phases in which ``case``'s implementation waits for each collective as it issues it: every phase on the
    backend ``cluster`` was calibrated on where it calls its collectives without ``async_op``
    (``Capabilities.collectives_block_on``: FSDP1 and FSDP2 on gloo), else those its options serialize
    (``Tunable.serialized_at``: a ZeRO-3 prefetch of 0, both; FSDP1 without backward prefetch, backward; DeepSpeed
    without ``overlap_comm``, backward). An option not given is at its default (``Tunable.values[0]``)."""
    caps = case.capabilities
    if caps is None:
        return frozenset()
    if cluster is not None and cluster.backend() in caps.collectives_block_on:
        return frozenset({"forward", "backward"})
    return frozenset().union(
        *(
            t.serialized_phases
            for t in caps.tunables
            if t.applies(case.stage, case.offload) and case.options.get(t.option, t.values[0]) in t.serialized_at
        )
    )


def simulate(rows: list[TracedRow], cluster: Cluster, scales: list[int]) -> list[SimulatedRow]:
    return [
        SimulatedRow(row, [] if row.trace.error else [estimate_row(row, cluster, world) for world in scales])
        for row in rows
    ]
