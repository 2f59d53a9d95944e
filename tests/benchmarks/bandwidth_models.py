"""Step models side by side on the same measured runs: ``validate_simulator``'s stored cases (its JSON keeps each
case's measured step and paired ratio, and both profiles) re-predicted from fresh traces with each profile as
measured (each memory-bound operator charged the bandwidth of its own working set, each operator its factor
inside a training step where the profile has them), with its operator factors left out (every factor 1: the
model before ``zbench.plan.calibrate.in_step``), and with its memory probes cut to the largest size (the earlier
model: every operator at DRAM's rate). DDP's noise twins are left out.

``python -m tests.benchmarks.bandwidth_models docs/data/validate_simulator_sizes.json``
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from scipy.stats import kendalltau

from zbench.cases.model_source import model_info
from zbench.plan.simulate.calibrated import predict_step
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.trace.plan import TracedRow, make_case, trace_plan


def traced(case_id: str) -> TracedRow:
    """The validation suite's case (micro-batch 4, the model's sequence, fp32, no offload) traced at its world."""
    model, implementation, stage, world = case_id.split("-")[:4]
    case = make_case(model, implementation, int(stage[1:]), "none", gpus=int(world[1:]), precision="fp32",
                     micro_batch=4, seq_len=model_info(model).default_seq_len, device="cpu",
                     checkpointing=False)  # fmt: skip
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


def summary(profile: Cluster, rows: dict[str, TracedRow], measured: dict[str, dict[str, Any]]) -> str:
    predicted = {case_id: predict_step(row, profile, cores=2).step_s for case_id, row in rows.items()}
    step_errors = [abs(predicted[c] / m["measured_s"] - 1) for c, m in measured.items()]
    ratios: list[tuple[float, float]] = []  # (predicted, measured) ratio to DDP of the same model and world
    for case_id, m in measured.items():
        model, implementation, _, world = case_id.split("-")[:4]
        if implementation != "ddp":
            ratios.append((predicted[case_id] / predicted[f"{model}-ddp-s0-{world}-fp32-none"], m["measured_ratio"]))
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
    for name in ("before", "after"):
        profile = document["profiles"][name]
        models = (
            ("as measured", Cluster.model_validate(profile)),
            ("no factors", without_factors(profile)),
            ("largest only", largest_probe_only(profile)),
        )
        for label, cluster in models:
            print(f"{name:6s} {label:12s} {summary(cluster, rows, measured)}")


if __name__ == "__main__":
    main()
