"""The simulator against published GPU training throughput (issue 30, item 4).

``python -m tests.benchmarks.validate_published --out docs/data/validate_published.json`` predicts every row of
docs/data/published_rows_to_predict.yaml (chosen, by the rules in its header, before any prediction was made)
from the published hardware description alone: the row's model (the real architecture where zbench has it, the
GPT preset of the same width and depth for MPT), its implementation, micro-batch, sequence length and activation
checkpointing are traced once on fake tensors at 8 ranks, then ``zbench plan --simulate``'s step model runs on
the row's datasheet cluster profile (``h100-sxm``, ``a100-sxm``) at the row's GPU count, twice: each traced
operator charged at the profile's published operator rates (``operators:``, ``zbench.plan.simulate.datasheet``),
and, for comparison, the model's FLOPs at the profile's assumed ``efficiency`` of the peak (the model before
operator rates). Nothing is fitted to a published row, and none is left out: the summary's median and worst
|error| are over all of them, per source, profile and published checkpointing too. The error is predicted
tokens/s per GPU over published, less one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from zbench.plan.simulate.cluster import load
from zbench.plan.simulate.sweep import simulate
from zbench.plan.trace.plan import TracedRow, default_device, make_case, trace_plan

ROWS = Path(__file__).resolve().parents[2] / "docs" / "data" / "published_rows_to_predict.yaml"
TRACED_AT = 8
"""Ranks of the fake process group each setup is traced in; the step model carries it to the row's GPU count."""


def trace_key(row: dict[str, Any]) -> tuple:
    return (row["model"], row["implementation"], row["stage"], row["micro_batch"], row["seq_len"], row["checkpointing"])


def predict_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row, in order, with its predictions; each distinct setup traced once, each profile loaded once."""
    keys = list(dict.fromkeys(trace_key(row) for row in rows))
    device = default_device()
    traced: dict[tuple, tuple[TracedRow, float]] = {}
    for i, key in enumerate(keys, 1):
        model, implementation, stage, micro_batch, seq_len, checkpointing = key
        print(
            f"[{i}/{len(keys)}] tracing {model} {implementation} stage {stage} micro-batch {micro_batch} "
            f"x {seq_len}{' checkpointing' if checkpointing else ''}",
            file=sys.stderr,
            flush=True,
        )
        started = time.perf_counter()
        case = make_case(
            model,
            implementation,
            stage,
            "none",
            gpus=TRACED_AT,
            precision="bf16",
            micro_batch=micro_batch,
            seq_len=seq_len,
            device=device,
            checkpointing=checkpointing,
        )
        (row_traced,) = trace_plan([case], device=device)
        traced[key] = (row_traced, time.perf_counter() - started)
    clusters = {name: load(name) for name in {row["cluster"] for row in rows}}
    out = []
    for row in rows:
        row_traced, trace_s = traced[trace_key(row)]
        cluster = clusters[row["cluster"]]
        (by_operators,) = simulate([row_traced], cluster, [row["gpus"]])
        (by_efficiency,) = simulate([row_traced], cluster.model_copy(update={"operators": None}), [row["gpus"]])
        out.append(
            {
                **row,
                "trace_s": round(trace_s, 1),
                "operators": prediction(row, by_operators),
                "peak_x_efficiency": prediction(row, by_efficiency),
            }
        )
    return out


def prediction(row: dict[str, Any], simulated: Any) -> dict[str, Any]:
    error = simulated.traced.trace.error
    if error or not simulated.estimates:
        return {"trace_error": error or "no estimate"}
    (est,) = simulated.estimates
    published = row["published_tokens_per_s_per_gpu"]
    return {
        "predicted_tokens_per_s_per_gpu": round(est.tokens_per_s_per_gpu, 1),
        "error": est.tokens_per_s_per_gpu / published - 1,
        "predicted_step_ms": round(est.step_s * 1e3, 1),
        "predicted_exposed_comm_ms": round(est.exposed_comm_s * 1e3, 1),
        "predicted_mfu": round(est.mfu, 4),
        "compute_model": est.compute_model,
    }


def stats(errors: list[float]) -> dict[str, Any]:
    return {
        "rows": len(errors),
        "median_abs": statistics.median(abs(e) for e in errors),
        "worst_abs": max(abs(e) for e in errors),
        "median_signed": statistics.median(errors),
    }


def summarise(predicted: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Median and worst |error| of the ``model`` predictions (``operators`` or ``peak_x_efficiency``)."""
    done = [r for r in predicted if "error" in r[model]]
    by: dict[str, dict[str, list[float]]] = {"source": {}, "cluster": {}, "published_checkpointing": {}}
    for r in done:
        for field, groups in by.items():
            groups.setdefault(str(r[field]), []).append(r[model]["error"])
    return {
        "all": stats([r[model]["error"] for r in done]) if done else {},
        "failed": [r["id"] for r in predicted if "error" not in r[model]],
        **{f"by_{field}": {k: stats(v) for k, v in groups.items()} for field, groups in by.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=Path, default=ROWS)
    parser.add_argument("--only", nargs="*", help="row ids (default: every row)")
    args = parser.parse_args()
    rows = yaml.safe_load(args.rows.read_text())["rows"]
    if args.only:
        rows = [r for r in rows if r["id"] in args.only]
    predicted = predict_rows(rows)
    for r in predicted:
        shown = [
            f"{p['predicted_tokens_per_s_per_gpu']:>8,.0f} {p['error']:+7.1%}" if "error" in p else p["trace_error"]
            for p in (r["operators"], r["peak_x_efficiency"])
        ]
        print(
            f"{r['id']:<9} {r['model']:<14} {r['cluster']:<9} {r['gpus']:>4} GPUs "
            f"{r['published_tokens_per_s_per_gpu']:>8,} published; operators {shown[0]}; "
            f"peak x efficiency {shown[1]}"
        )
    summary = {model: summarise(predicted, model) for model in ("operators", "peak_x_efficiency")}
    for model, s in summary.items():
        by_source = {k: round(v["median_abs"], 3) for k, v in s["by_source"].items()}
        print(model, json.dumps(s["all"]), "by source", by_source)
    args.out.write_text(json.dumps({"rows_file": str(args.rows.name), "summary": summary, "rows": predicted}, indent=1))


if __name__ == "__main__":
    main()
