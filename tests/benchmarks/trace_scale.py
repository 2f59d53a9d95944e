"""Traced against formula model-state bytes per rank at scale, through the real CLI: the table in docs/methods.md.

For every model x world size, ``zbench plan --trace --model M --gpus N -i ddp -i zero1 -i zero2 -i zero3
-i fsdp -o none --json`` (bf16), timed as a whole command with ``/usr/bin/time``-style wall clock and peak
resident memory of the child. Writes the raw rows to ``--out`` (JSON) and prints a Markdown table:
per model, world and implementation, the device model states traced and by the formula, their
difference, and the live peak.

``python -m tests.benchmarks.trace_scale --models gpt-1.3b gpt-6.7b gpt-70b --worlds 8 64 1024
--out docs/data/trace_scale.json`` from the repository root (about 20 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

IMPLEMENTATIONS = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def trace(model: str, world: int) -> dict:
    args = [sys.executable, "-m", "zbench", "plan", "--trace", "--model", model, "--gpus", str(world), "-o", "none"]
    args += [a for impl in IMPLEMENTATIONS for a in ("-i", impl)] + ["--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if r.returncode:
        raise SystemExit(f"{model} x {world}: exit {r.returncode}\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout)
    out["wall_s"] = round(seconds, 1)
    out["max_rss_kib_children"] = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return out


def located(data: dict, where: str) -> float:
    return sum(locs.get(where, 0) for locs in data.values())


def table(runs: list[dict]) -> str:
    lines = [
        "| model | ranks | implementation | states per GPU, traced (GiB) | formula (GiB) | difference "
        "| live peak (GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for row in run["rows"]:
            traced, formula = located(row["trace"]["state_bytes"], "device"), located(row["formula"], "device")
            diff = f"{(traced - formula) / formula:+.2%}" if formula else "-"
            peak = row["trace"]["peak"].get("device", {}).get("bytes", 0)
            lines.append(
                f"| {run['model']} | {run['gpus']} | {row['implementation']} | {gib(traced)} | {gib(formula)} | "
                f"{diff} | {gib(peak)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-1.3b", "gpt-6.7b", "gpt-70b"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[8, 64, 1024])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    for model in args.models:
        for world in args.worlds:
            run = trace(model, world)
            errors = [r["name"] + ": " + r["trace"]["error"] for r in run["rows"] if r["trace"]["error"]]
            print(f"{model} x {world}: {run['wall_s']} s ({len(run['rows'])} traces)", *errors, file=sys.stderr)
            runs.append(run)
            if args.out:
                args.out.write_text(json.dumps(runs, indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
