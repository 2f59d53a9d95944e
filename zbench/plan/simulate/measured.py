"""The simulator against real CPU runs: predict each stored case's step time and compare with what it measured.

On a CPU there is no peak to take a share of, so compute is *measured*: the reference DDP case of the same
group gives forward, backward and optimizer times (its backward less the all-reduce the model predicts for
it, since DDP's backward includes that). Each case is then traced (fake tensors, a fake group mirroring
gloo, at its world size) and its step predicted as forward + backward + its exposed communication at the
bus bandwidth the run itself probed + the optimizer time shared over the ranks that shard it. gloo on a
loaded 2-core machine runs beside compute poorly, so nothing is assumed hidden (``overlap`` 0) except
what the trace puts after nothing. DDP's own prediction equals its measurement by construction and is
left out of the errors; what is checked is every other implementation's communication and structure.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from zbench.atomic import atomic_write_json
from zbench.plan.simulate.cluster import Cluster, Link
from zbench.plan.simulate.run_file import SIMULATION_FILE, Prediction, RunSimulation
from zbench.plan.simulate.step import estimate
from zbench.plan.trace.plan import TracedRow
from zbench.results.record import CaseRecord
from zbench.results.store import RunDir, now

#: gloo's per-hop latency on one host (TCP over loopback), microseconds; an assumption, see docs/methods.md.
GLOO_LATENCY_US = 50.0


def cpu_cluster(bus_bandwidth_bytes_per_s: float, world: int) -> Cluster:
    """One host whose ranks talk over gloo at the probed bandwidth; compute comes from measurements."""
    link = Link(bandwidth_gb_s=bus_bandwidth_bytes_per_s / 1e9, latency_us=GLOO_LATENCY_US)
    return Cluster(
        name="cpu-run", gpu="CPU", peak_tflops=1.0, memory_gib=1.0, efficiency=1.0, gpus_per_node=max(world, 1),
        intra_node=link, inter_node=link, pcie_gb_s=1e3, nvme_gb_s_per_node=1e3, host_adam_params_per_s=1e12,
        overlap=0.0,
    )  # fmt: skip


def predict(records: list[CaseRecord], traced: dict[str, TracedRow]) -> list[Prediction]:
    """Every ok, traced case of a run that has an ok DDP reference in its group."""
    by_id = {r.case_id: r for r in records}
    out = []
    for record in records:
        row = traced.get(record.case_id)
        ref = by_id.get(record.equivalence.reference_case or "") if record.equivalence else None
        if record.status != "ok" or row is None or row.trace.error or ref is None or ref.status != "ok":
            continue
        ref_row = traced.get(ref.case_id)
        if ref_row is None or ref_row.trace.error or ref.phases is None or record.comms is None:
            continue
        case, world = row.case, row.case.world_size
        cluster = cpu_cluster(record.comms.bus_bandwidth_bytes_per_s or 1e9, world)
        kw: dict[str, Any] = dict(cluster=cluster, world=world, flops_per_step=0.0, params=1, stage=case.stage,
                                  offload="none", checkpointing=False, tokens_per_step=1)  # fmt: skip
        ref_comm = estimate(ref_row.trace.phases, **kw).exposed_comm_s
        forward = ref.phases.forward_s or 0.0
        backward = max(0.0, (ref.phases.backward_s or 0.0) - ref_comm)
        optimizer = (ref.phases.optimizer_s or 0.0) / (world if case.stage >= 1 else 1)
        comm = estimate(row.trace.phases, **kw).exposed_comm_s
        measured = record.summary.step_time_median_s or 0.0
        out.append(
            Prediction(
                case_id=case.case_id, implementation=case.implementation, world=world, measured_s=measured,
                predicted_s=forward + backward + comm + optimizer, comm_s=comm,
            )
        )  # fmt: skip
    return out


def summary(predictions: list[Prediction]) -> dict[str, float]:
    errors = [abs(p.error) for p in predictions if p.implementation != "ddp"]
    if not errors:
        return {}
    return {"cases": len(errors), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}


METHOD = (
    "compute measured from each group's DDP reference; communication traced on fake tensors and timed "
    f"alpha-beta at the run's probed gloo bandwidth with a {GLOO_LATENCY_US:.0f} us hop; nothing hidden"
)


def trace_records(records: list[CaseRecord], progress: Callable[[str], None] = lambda _: None) -> dict[str, TracedRow]:
    """Trace every finished case at its own world size on fake CPU tensors, in a fake group that mirrors the
    backend the case ran on (gloo on CPU, NCCL on GPUs: the reference engine takes another path per backend)."""
    import torch

    from zbench.plan.trace.heartbeat import Heartbeat
    from zbench.plan.trace.shims import fake_world
    from zbench.plan.trace.tracer import trace_case

    def backend(record: CaseRecord) -> str:
        return "nccl" if record.config.device == "cuda" else "gloo"

    traced: dict[str, TracedRow] = {}
    for world, name in sorted({(r.config.world_size, backend(r)) for r in records}):
        with fake_world(world, backend=name), Heartbeat(progress) as beat:
            for record in records:
                if record.config.world_size == world and backend(record) == name and record.status == "ok":
                    progress(f"tracing {record.case_id}")
                    case = record.config
                    beat.task(case.case_id)
                    trace = trace_case(case, fake=True, device=torch.device("cpu"), on_phase=beat.phase)
                    traced[case.case_id] = TracedRow(case, trace)
    return traced


def simulate_run(run: RunDir, progress: Callable[[str], None] = lambda _: None) -> RunSimulation:
    """Trace and predict every case of ``run`` and store the result beside it (atomically)."""
    records = run.cases()
    traced = trace_records(records, progress)
    predictions = predict(records, traced)
    done = {p.case_id for p in predictions}
    missing = {r.case_id: _why_not(r, traced.get(r.case_id)) for r in records if r.case_id not in done}
    stats = summary(predictions)
    result = RunSimulation(
        created_at=now(), predictions=predictions, not_predicted=missing,
        median_abs_error=stats.get("median_abs_error"), worst_abs_error=stats.get("worst_abs_error"), method=METHOD,
    )  # fmt: skip
    atomic_write_json(run.path / SIMULATION_FILE, result.model_dump(mode="json"))
    return result


def _why_not(record: CaseRecord, row: TracedRow | None) -> str:
    if record.status != "ok":
        return f"case {record.status}"
    if row is None or row.trace.error:
        return f"cannot trace: {row.trace.error}" if row else "not traced"
    eq = record.equivalence
    if eq is None or not eq.reference_case:
        return "no DDP reference in its group (compute is taken from the reference's measured phases)"
    return "its DDP reference has no phase times or the case no communication record"
