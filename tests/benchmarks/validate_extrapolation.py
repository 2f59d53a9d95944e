"""How far ``zbench tune``'s extrapolated traces (two cuts of the model, 5 and 6 blocks, extrapolated over blocks:
``zbench.tune.extrapolate``) are from whole traces, for every implementation x offload mode that traces here.

    python tests/benchmarks/validate_extrapolation.py [--out docs/data/validate_extrapolation.json]

Two settings, each every blockwise built-in x stage x offload mode on fake CPU tensors:

- gpt-350m (24 blocks, width 1,024) at 2 ranks, micro-batch 1, 64 tokens, no checkpointing;
- gpt-1.3b (24 blocks, width 2,048) at 8 ranks, micro-batch 2, 64 tokens, activation checkpointing.

For each: model-state bytes per location, the peak of live bytes on the device, bytes sent per step, and the
predicted step on h100-sxm's datasheet operator rates, each as (extrapolated - whole) / whole. Writes the table
and its worst figures as JSON; prints a line per setup.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from zbench.plan.simulate.cluster import load
from zbench.plan.simulate.sweep import estimate_row
from zbench.plan.trace.plan import TracedRow, combinations, make_case, trace_plan
from zbench.tune.extrapolate import Extrapolated, can_extrapolate, cuts
from zbench.tune.search import needs_of

SETTINGS = (
    {"model": "gpt-350m", "world": 2, "micro_batch": 1, "checkpointing": False},
    {"model": "gpt-1.3b", "world": 8, "micro_batch": 2, "checkpointing": True},
)
IMPLEMENTATIONS = ("ddp", "fsdp", "fsdp1", "torch_zero", "zero1", "zero2", "zero3")
SEQ = 64


def _figures(row: TracedRow, step_s: float) -> dict[str, float]:
    needs = needs_of(row, 1)
    return {
        "states_device": row.located("device"),
        "states_host": row.located("host"),
        "states_disk": row.located("disk"),
        "peak_device": needs.gpu,
        "sent_per_step": float(sum(e["bytes"] for ops in row.trace.phases.values() for e in ops.values())),
        "step_s_h100": step_s,
    }


def _error(whole: float, extrapolated: float) -> float:
    if whole == 0:
        return 0.0 if extrapolated == 0 else float("inf")
    return (extrapolated - whole) / whole


def validate(setting: dict) -> list[dict]:
    cluster = load("h100-sxm")
    combos = combinations(IMPLEMENTATIONS, ("none", "optimizer", "optimizer+params", "nvme"), "cpu")
    cases = [
        make_case(
            setting["model"],
            name,
            stage,
            offload,
            gpus=setting["world"],
            precision="bf16",
            micro_batch=setting["micro_batch"],
            seq_len=SEQ,
            device="cpu",
            checkpointing=setting["checkpointing"],
        )
        for name, stage, offload in combos
    ]
    cases = [c for c in cases if can_extrapolate(c)]
    jobs = [job for c in cases for job in (c, *cuts(c))]
    started = time.perf_counter()
    rows = trace_plan(jobs, device="cpu", progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{setting['model']}: {len(jobs)} traces in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    out = []
    for i, case in enumerate(cases):
        whole, shallow, deeper = rows[3 * i : 3 * i + 3]
        line = Extrapolated(case, shallow, deeper)
        entry = {"implementation": case.implementation, "stage": case.stage, "offload": case.offload}
        if whole.trace.error or line.error:
            out.append({**entry, "error": whole.trace.error or line.error})
            continue
        ext = line.row()
        w = _figures(whole, estimate_row(whole, cluster, case.world_size).step_s)
        e = _figures(
            ext, estimate_row(ext, cluster, case.world_size, line.phase_compute(cluster, case.world_size)).step_s
        )
        errors = {k: _error(w[k], e[k]) for k in w}
        seconds = {"whole": whole.trace.seconds, "cuts": shallow.trace.seconds + deeper.trace.seconds}
        out.append({**entry, "whole": w, "extrapolated": e, "error": errors, "trace_seconds": seconds})
        print(f"{setting['model']} {case.implementation:10} {case.stage} {case.offload:17} "
              + " ".join(f"{k}={v:+.3%}" for k, v in errors.items()))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/data/validate_extrapolation.json"))
    args = parser.parse_args()
    results = {}
    for setting in SETTINGS:
        rows = validate(setting)
        measured = [r for r in rows if isinstance(r["error"], dict)]
        worst = {k: max(abs(r["error"][k]) for r in measured) for k in measured[0]["error"]} if measured else {}
        speedup = [r["trace_seconds"]["whole"] / r["trace_seconds"]["cuts"] for r in measured]
        results[setting["model"]] = {"setting": {**setting, "seq_len": SEQ}, "worst_abs_error": worst,
                                     "trace_speedup_median": sorted(speedup)[len(speedup) // 2] if speedup else None,
                                     "rows": rows}  # fmt: skip
    document = {
        "measured": str(date.today()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "what": __doc__.split("\n\n")[0],
        "settings": results,
    }
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    for name, r in results.items():
        print(name, {k: f"{v:.3%}" for k, v in r["worst_abs_error"].items()}, f"speedup {r['trace_speedup_median']}")


if __name__ == "__main__":
    main()
