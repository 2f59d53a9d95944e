"""The simulator against measured runs with nothing taken from the runs: a calibrated profile
(``zbench calibrate``, made apart from them) and each case's trace predict its step time and its ratio to DDP.

Unlike ``zbench.plan.simulate.measured`` (which takes compute from each group's measured DDP case), compute
here is the traced operators at the calibrated costs plus the implementation's calibrated host work
(``zbench.plan.simulate.compute``; both measured on other models than the cases), communication the
traced collectives on the profile's link, the optimizer step's operators included. Two errors per case:
the step time against the measured median, and the predicted ratio to the group's DDP case against the
measured one (the paired ratio when the run paired, the figure zbench gates on).

On a CPU a rank's share of the cores differs from the calibration's one thread per rank: a world-1 case's
rank runs ``cores`` threads, and four ranks on two cores share them. The operators' work is scaled by that share
(``compute.cpu_share``): by the speed-up the calibration measured on every core, else as if a rate scaled with its
threads; their dispatch and the implementation's host work, Python on one thread, only where a rank has less
than a core.
"""

from __future__ import annotations

from pydantic import computed_field

from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.compute import case_phase_seconds
from zbench.plan.simulate.run_file import Prediction
from zbench.plan.simulate.step import StepEstimate
from zbench.plan.simulate.sweep import estimate_row
from zbench.plan.trace.plan import TracedRow
from zbench.results.record import CaseRecord


class CalibratedPrediction(Prediction):
    """A case's step prediction (``comm_s`` the exposed communication), with its ratio to DDP next to the
    measured one."""

    model: str | None = None
    measured_ratio: float | None
    predicted_ratio: float | None
    reference_case: str | None = None
    """The DDP case of the same group both ratios are to, where it ran and was traced."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ratio_error(self) -> float | None:
        if self.measured_ratio is None or self.predicted_ratio is None:
            return None
        return (self.predicted_ratio - self.measured_ratio) / self.measured_ratio


def predict_step(row: TracedRow, cluster: Cluster, *, cores: int) -> StepEstimate:
    """One traced case's step time at its own world size on ``cluster`` (calibrated), its compute charged at a
    CPU rank's share of ``cores`` (``compute.case_phase_seconds``)."""
    cal = cluster.calibration
    if cal is None:
        raise ValueError(f"profile {cluster.name} is not calibrated: no operator costs to charge")
    world = row.case.world_size
    return estimate_row(row, cluster, world, case_phase_seconds(row.trace.ops, cal, row.case, world=world, cores=cores))


def predict_calibrated(
    records: list[CaseRecord], traced: dict[str, TracedRow], cluster: Cluster, *, cores: int
) -> list[CalibratedPrediction]:
    """Every ok, traced case; its ratio where its group's DDP reference is ok and traced too."""
    by_id = {r.case_id: r for r in records}
    steps = {
        case_id: predict_step(row, cluster, cores=cores) for case_id, row in traced.items() if row.trace.error is None
    }
    out = []
    for record in records:
        mine = steps.get(record.case_id)
        measured = record.summary.step_time_median_s if record.summary else None
        if record.status != "ok" or mine is None or not measured:
            continue
        ref_id = record.equivalence.reference_case if record.equivalence else None
        ref, ref_step = by_id.get(ref_id or ""), steps.get(ref_id or "")
        ok_ref = ref_step is not None and ref is not None and ref.status == "ok" and ref_step.step_s > 0
        out.append(
            CalibratedPrediction(
                case_id=record.case_id, implementation=record.config.implementation, world=record.config.world_size,
                model=record.config.model,
                measured_s=measured, predicted_s=mine.step_s, comm_s=mine.exposed_comm_s,
                measured_ratio=record.ratio_to_ddp,
                predicted_ratio=mine.step_s / ref_step.step_s if ok_ref and ref_step is not None else None,
                reference_case=ref_id if ok_ref else None,
            )
        )  # fmt: skip
    return out
