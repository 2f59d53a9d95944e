"""Step models side by side on the same measured runs: ``validate_simulator``'s stored cases (its JSON keeps each
case's measured step and paired ratio, and both profiles) re-predicted from fresh traces with each profile as
measured (each memory-bound operator charged the bandwidth of its own working set, each operator its factor
inside a training step where the profile has them, each implementation's host work per parameter element where it
has it or, in a profile from before it was kept (schema 6), as ``overheads.fit`` derives it today from the stored
wide probe and its operators traced afresh), without that element term, with its operator factors left out (every
factor 1: the model before ``zbench.plan.calibrate.in_step``), with its fp32 factors alone (a bf16 operator at its
fp32 factor: the model before the autocast probe), and with its memory probes cut to the largest size (the earlier
model: every operator at DRAM's rate). DDP's noise twins are left out.

``python -m tests.benchmarks.bandwidth_models docs/data/validate_simulator_sizes.json``
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import torch.distributed as dist
from scipy.stats import kendalltau

from zbench.cases.model_source import model_info
from zbench.plan.calibrate import overheads
from zbench.plan.simulate.calibrated import predict_step
from zbench.plan.simulate.calibration import is_dtype_factor, overhead_key
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.trace.plan import TracedRow, make_case, trace_plan


def traced(case_id: str) -> TracedRow:
    """The validation suite's case (micro-batch 4, the model's sequence) traced at its world, its precision,
    offload and activation checkpointing read off its id (``small-zero3-s3-w2-bf16-none-ckpt``)."""
    model, implementation, stage, world, precision, offload, *rest = case_id.split("-")
    case = make_case(model, implementation, int(stage[1:]), offload, gpus=int(world[1:]), precision=precision,
                     micro_batch=4, seq_len=model_info(model).default_seq_len, device="cpu",
                     checkpointing="ckpt" in rest)  # fmt: skip
    (row,) = trace_plan([case], device="cpu")
    return row


def with_calibration(profile: dict[str, Any], **changed: Any) -> Cluster:
    """``profile`` with some of its calibration's tables replaced."""
    return Cluster.model_validate({**profile, "calibration": {**profile["calibration"], **changed}})


def largest_probe_only(profile: dict[str, Any]) -> Cluster:
    memory = profile["calibration"]["memory_bound"]
    largest = max(b["bytes"] for b in memory)
    kept = [b for b in memory if b["bytes"] == largest]
    return with_calibration(profile, memory_bound=kept, operator_factors={})


def without_factors(profile: dict[str, Any]) -> Cluster:
    return with_calibration(profile, operator_factors={})


def fp32_factors_only(profile: dict[str, Any]) -> Cluster:
    """Every operator at its fp32 factor, whatever its dtype (the model before the autocast probe)."""
    factors = profile["calibration"].get("operator_factors", {})
    return with_calibration(profile, operator_factors={op: f for op, f in factors.items() if not is_dtype_factor(op)})


def wide_probe_ops(keys: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The operators of one step of each implementation's wide probe (``overheads.probe_ops``), traced now."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return {key: overheads.probe_ops(key.rsplit("-s", 1)[0], int(key.rsplit("-s", 1)[1]), *overheads.PROBES[-1])
                for key in sorted(keys)}  # fmt: skip
    finally:
        dist.destroy_process_group()


def with_element_term(profile: dict[str, Any], wide_ops: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``profile`` as it stands where it has the element term, else with the term ``overheads.fit`` would have
    fitted from its stored probes (narrow residuals, wide steps) and ``wide_ops``."""
    stored = profile["calibration"]["overheads"]
    if any("per_element_us" in o for o in stored.values()):
        return profile
    blocks, width, _ = overheads.PROBES[-1]
    probes = [
        {"key": key, "blocks": int(depth), "width": overheads.NARROW, "seconds": us * 1e-6, "ops": []}
        for key in wide_ops for depth, us in stored[key]["residuals_us"].items()
    ] + [
        {"key": key, "blocks": blocks, "width": width, "ops": ops,
         "seconds": stored[key]["measured_us"][overheads.label(blocks, width)] * 1e-6}
        for key, ops in wide_ops.items()
    ]  # fmt: skip
    fitted = overheads.fit(probes, Cluster.model_validate(profile).calibration)
    terms = {key: {**o, "per_element_us": fitted[key].per_element_us if key in fitted else 0.0}
             for key, o in stored.items()}  # fmt: skip
    return {**profile, "calibration": {**profile["calibration"], "overheads": terms}}


def without_element_term(profile: dict[str, Any]) -> Cluster:
    terms = {key: {**o, "per_element_us": 0.0} for key, o in profile["calibration"]["overheads"].items()}
    return with_calibration(profile, overheads=terms)


def reference(case: dict[str, Any]) -> str:
    """The DDP case a case's ratio is to: as stored, or (files from before it was) its id with DDP's parts."""
    if case.get("reference_case"):
        return str(case["reference_case"])
    model, _, _, world, precision, _, *rest = case["case_id"].split("-")
    return "-".join([model, "ddp", "s0", world, precision, "none", *rest])


def summary(profile: Cluster, rows: dict[str, TracedRow], measured: dict[str, dict[str, Any]]) -> str:
    predicted = {case_id: predict_step(row, profile, cores=2).step_s for case_id, row in rows.items()}
    step_errors = [abs(predicted[c] / m["measured_s"] - 1) for c, m in measured.items()]
    ratios: list[tuple[float, float]] = []  # (predicted, measured) ratio to DDP of the same model and world
    for case_id, m in measured.items():
        if m["implementation"] != "ddp" and m.get("measured_ratio") is not None:
            ratios.append((predicted[case_id] / predicted[reference(m)], m["measured_ratio"]))
    ratio_errors = [abs(p / m - 1) for p, m in ratios]
    tau = kendalltau([p for p, _ in ratios], [m for _, m in ratios]).statistic
    return (
        f"step median {statistics.median(step_errors):.1%} worst {max(step_errors):.1%} | ratio median "
        f"{statistics.median(ratio_errors):.1%} worst {max(ratio_errors):.1%} | tau {tau:.2f} | "
        f"{len(step_errors)} steps, {len(ratios)} ratios"
    )


def main() -> None:
    document = json.loads(open(sys.argv[1]).read())
    measured = {p["case_id"]: p for p in dict(document["cases"])["before"] if not p["case_id"].endswith("-twin")}
    rows = {case_id: traced(case_id) for case_id in measured}
    keys = {overhead_key(r.case.implementation, r.case.stage) for r in rows.values()}
    wide_ops = wide_probe_ops(keys)
    for name in ("before", "after"):
        profile = with_element_term(document["profiles"][name], wide_ops)
        models = (
            ("as measured", Cluster.model_validate(profile)),
            ("no elements", without_element_term(profile)),
            ("no factors", without_factors(profile)),
            ("fp32 factors", fp32_factors_only(profile)),
            ("largest only", largest_probe_only(profile)),
        )
        for label, cluster in models:
            print(f"{name:6s} {label:12s} {summary(cluster, rows, measured)}")


if __name__ == "__main__":
    main()
