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
#: largest of the sittings on the per-call-shape factors (2026-11-30, the 2-core CPU machine: 3.1% and 3.1% over
#: _1130f's two calibrations, 3.0% over _1130g's first; its second, whose ZeRO probes drifted, read 14%; the model
#: before, one factor per operator: 3.2-5.6%).
CALIBRATED_RATIO_ERROR = 0.031

#: What each compute model's predictions (``Cluster.compute_model``) measured against runs they were not fitted
#: to, shown beside them (docs/methods.md#simulation; each figure with its date, machines and data file).
MEASURED_ERROR = {
    "calibrated": "measured error on a calibrated CPU profile, this model (a factor per operator call shape inside "
    "a step, the probe steps' residual): one run of 64 cases (small and medium, worlds 1-2, fp32 and bf16; the "
    "2-core CPU machine, 2026-11-30; docs/data/validate_simulator_1130g.json): with the calibration before the runs "
    "step time median 13% (medium 7.7%, small 21%: under-predicted), worst 37%; ratio to DDP median 3.0%, worst "
    "9.7%, Kendall tau 0.79. The calibration after them read the ZeRO implementations' wide probe during a slow "
    "spell and put their ratios a median 14% (worst 38%) too high: compare two calibrations before trusting one. "
    "Without the residual (the same runs): step median 19%, worst 42%. The model before (one factor per operator), "
    "four runs and eight calibrations (_1130, _1130b, _1130c, _1130e): step median 11-20%, worst 39-61%; ratio "
    "median 3.2-5.6%, worst 18-40%, tau 0.55-0.86",
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
