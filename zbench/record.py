"""Turn what the ranks of a case handed back into the case's stored record (design §4)."""

from __future__ import annotations

import statistics

from zbench import registry
from zbench.formulas import placement_for
from zbench.launch import Outcome
from zbench.measure.comms import theory_elements as comm_theory
from zbench.measure.flops import derived
from zbench.models import get_config
from zbench.measure.timing import summarize
from zbench.protocol import CATEGORIES, LOCATIONS
from zbench.suite import Case


def skipped_record(case: Case) -> dict:
    return {"case_id": case.case_id, "config": case.to_dict(), "status": "skipped", "skip_reason": case.skip_reason}


def case_record(case: Case, outcome: Outcome, *, started_at: str, ended_at: str) -> dict:
    record = {"case_id": case.case_id, "config": case.to_dict(), "status": outcome.status, "error": outcome.error,
              "stderr_tail": outcome.stderr_tail if outcome.status != "ok" or outcome.warnings else "", "exit_codes": outcome.exit_codes,
              "rank_pids": outcome.pids, "warnings": outcome.warnings,
              "started_at": started_at, "ended_at": ended_at, "wall_s": outcome.wall_s}
    if outcome.status == "ok":
        record.update(_measurements(case, sorted(outcome.ranks, key=lambda r: r["rank"])))
    return record


def _measurements(case: Case, ranks: list[dict]) -> dict:
    steps = []
    for i in range(case.steps):
        loss = sum(r["losses"][i] for r in ranks) / len(ranks)
        seconds = max(r["step_times_s"][i] for r in ranks)
        steps.append({"step": i, "loss": loss, "step_time_s": seconds, "warmup": i < case.warmup_steps,
                      **ranks[0]["phases"][i], **ranks[0]["metrics"][i]})
    stats = summarize([s["step_time_s"] for s in steps if not s["warmup"]])
    tokens_per_step = case.global_batch * case.seq_len
    params = ranks[0]["parameters"]
    cfg = get_config(case.model)
    comms = comm_summary(case, ranks, params)
    phases = phase_summary(steps, ranks[0]["clock"])
    comms["comm_to_compute"] = comm_to_compute(comms, phases)
    return {
        "throughput": {**derived(cfg, tokens_per_step=tokens_per_step, step_time_s=stats["median"], world=case.world_size,
                                 precision=case.precision, gpu_name=ranks[0].get("gpu_name")),
                       "gpu_name": ranks[0].get("gpu_name")} if stats["median"] else {},
        "energy": energy_summary(ranks, case.steps, case.warmup_steps, tokens_per_step),
        "time_to_target": time_to_target(steps, case.target_loss),
        "model_parameters": params,
        "steps": steps,
        "summary": {"step_time_median_s": stats["median"], "step_time_iqr_s": stats["iqr"],
                    "step_time_q1_s": stats["q1"], "step_time_q3_s": stats["q3"],
                    "tokens_per_s": tokens_per_step / stats["median"] if stats["median"] else None,
                    "tokens_per_s_per_rank": tokens_per_step / stats["median"] / case.world_size if stats["median"] else None,
                    "final_loss": steps[-1]["loss"]},
        "memory": {"kind": ranks[0]["memory"]["kind"], "peak_bytes": max(r["memory"]["bytes"] for r in ranks),
                   "per_rank": [r["memory"] for r in ranks]},
        "model_state": model_state(case, ranks),
        "comms": comms,
        "phases": phases,
    }


def comm_summary(case: Case, ranks: list[dict], params: int) -> dict:
    """Per step and rank: collectives by kind, their logical volume, and theory (design §5)."""
    timed = [i for i in range(case.steps) if i >= case.warmup_steps]
    busiest = max(ranks, key=lambda r: sum(e["elements"] for i in timed for e in r["comms"][i]))
    per_step = [sum(e["elements"] for e in busiest["comms"][i]) for i in timed]
    median = sorted(per_step)[len(per_step) // 2] if per_step else 0
    by_op: dict[str, dict] = {}
    last = busiest["comms"][timed[-1]] if timed else []
    for e in last:
        slot = by_op.setdefault(f"{e['op']} ({e['dtype']})", {"count": 0, "elements": 0, "bytes": 0})
        for k in ("count", "elements", "bytes"):
            slot[k] += e[k]
    expected = ranks[0]["expected_comm_elements"]
    design = comm_theory(params, case.stage)
    bytes_per_step = sum(v["bytes"] for v in by_op.values())
    bandwidth = min((r["bus_bandwidth_bytes_per_s"] for r in ranks if r.get("bus_bandwidth_bytes_per_s")), default=None)
    return {"elements_per_step": median, "bytes_per_step": bytes_per_step,
            "per_step_elements": per_step, "by_op": by_op,
            "expected_elements": expected, "design_elements": design,
            "error_rel": (median - expected) / expected if expected else None,
            "bus_bandwidth_bytes_per_s": bandwidth,
            "est_time_s": bytes_per_step / bandwidth if bandwidth else None}


def phase_summary(steps: list[dict], clock: str) -> dict:
    """Median forward / backward / optimizer seconds over the timed steps (rank 0, see zbench.measure.phases)."""
    timed = [s for s in steps if not s["warmup"]]
    out: dict = {"clock": clock}
    for key in ("device_step_s", "forward_s", "backward_s", "optimizer_s"):
        values = [s[key] for s in timed if s.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def comm_to_compute(comms: dict, phases: dict) -> float | None:
    """Estimated communication time per step (volume / probed bandwidth) over forward + backward time."""
    compute = (phases.get("forward_s") or 0.0) + (phases.get("backward_s") or 0.0)
    return comms["est_time_s"] / compute if comms.get("est_time_s") is not None and compute > 0 else None


def energy_summary(ranks: list[dict], steps: int, warmup_steps: int, tokens_per_step: int) -> dict:
    """nvml figures per rank; energy per step and per token over the timed steps, summed over ranks (all GPUs)."""
    nvml = [r.get("nvml") or {"available": False} for r in ranks]
    if not all(n.get("available") for n in nvml):
        return {"available": False, "reason": next((n.get("reason") for n in nvml if not n.get("available")), "")}
    energy = [n["energy_j"] for n in nvml]
    timed = [n.get("energy_timed_j") for n in nvml]
    total = sum(energy) if all(e is not None for e in energy) else None
    timed_total = sum(timed) if all(e is not None for e in timed) else None
    timed_steps = steps - warmup_steps
    return {"available": True, "per_rank": nvml, "peak_used_bytes": max(n["peak_used_bytes"] or 0 for n in nvml),
            "energy_j": total, "energy_timed_j": timed_total,
            "energy_per_step_j": timed_total / timed_steps if timed_total is not None else None,
            "energy_per_token_j": timed_total / (timed_steps * tokens_per_step) if timed_total is not None else None}


def time_to_target(steps: list[dict], target: float | None) -> dict | None:
    """The first step whose loss reached the suite's ``target_loss``, and the training time until then."""
    if target is None:
        return None
    for s in steps:
        if s["loss"] <= target:
            return {"target_loss": target, "reached": True, "steps": s["step"] + 1,
                    "seconds": sum(x["step_time_s"] for x in steps[: s["step"] + 1])}
    return {"target_loss": target, "reached": False, "steps": None, "seconds": None}


def model_state(case: Case, ranks: list[dict]) -> dict:
    """Measured bytes (the fullest rank) by category and location next to the formulas' placement (design §5)."""
    per_rank = [r["state_bytes"] for r in ranks]
    fullest = max(per_rank, key=lambda s: sum(sum(v.values()) for v in s.values()))
    measured = {c: {loc: fullest.get(c, {}).get(loc, 0) for loc in LOCATIONS} for c in CATEGORIES}
    predicted = placement_for(case, registry.resolve(case.implementation).capabilities)
    by_location = {loc: {"measured": sum(measured[c][loc] for c in CATEGORIES),
                         "predicted": sum(predicted[c][loc] for c in CATEGORIES)} for loc in LOCATIONS}
    for v in by_location.values():
        v["error_rel"] = (v["measured"] - v["predicted"]) / v["predicted"] if v["predicted"] else None
    measured_total = sum(v["measured"] for v in by_location.values())
    expected_total = sum(v["predicted"] for v in by_location.values())
    return {"measured": measured, "predicted": predicted, "by_location": by_location,
            "expected": {c: sum(predicted[c].values()) for c in CATEGORIES}, "per_rank": per_rank,
            "measured_total": measured_total, "expected_total": expected_total,
            "error_rel": (measured_total - expected_total) / expected_total if expected_total else None}
