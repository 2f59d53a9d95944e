"""The simulator against real CPU runs (issue 14 item 5): run a suite, trace every case, predict, compare.

Runs ``zbench run`` on the suite below (tiny and small GPT, worlds 1, 2 and 4, every built-in
implementation, fp32; or ``--results RUN`` to reuse a stored run), traces each case on fake tensors in a
fake group mirroring gloo (``zbench.plan.trace``), predicts its step time with ``zbench.plan.simulate.measured``
and prints per case measured vs predicted, then the median and worst absolute error over the non-DDP
cases. ``python -m tests.benchmarks.simulate_cpu_runs --out docs/data/simulate_cpu_runs.json``
(about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from zbench.plan.simulate.measured import predict, summary, trace_records
from zbench.results.store import RunDir

SUITE = """
name: simulate-cpu
device: cpu
models: [tiny, small]
implementations: [ddp, fsdp, torch_zero, zero1, zero2, zero3]
world_sizes: [1, 2, 4]
precisions: [fp32]
steps: 8
warmup_steps: 2
micro_batch: 4
seed: 0
timeout_s: 600
paired_rounds: 0
optimizer: {name: adamw, lr: 0.001, weight_decay: 0.01}
"""


def run_suite(tmp: Path) -> Path:
    (tmp / "suite.yaml").write_text(SUITE)
    results = tmp / "results"
    cmd = [sys.executable, "-m", "zbench", "run", str(tmp / "suite.yaml"), "--results", str(results),
           "--report", str(tmp / "report")]  # fmt: skip
    subprocess.run(cmd, check=False)
    return next(results.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="a stored run's directory (default: run the suite)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.results or run_suite(Path(tmp))
        records = RunDir(run.parent, run.name).cases()
        predictions = predict(records, trace_records(records))
    print("| case | measured (ms) | predicted (ms) | of which communication (ms) | error |")
    print("|---|---|---|---|---|")
    for p in predictions:
        print(f"| {p.case_id} | {p.measured_s * 1e3:.1f} | {p.predicted_s * 1e3:.1f} | {p.comm_s * 1e3:.1f} | "
              f"{p.error:+.0%} |")  # fmt: skip
    stats = summary(predictions)
    print(json.dumps(stats))
    if args.out:
        args.out.write_text(json.dumps({"summary": stats, "cases": [p.model_dump() for p in predictions]}, indent=1))


if __name__ == "__main__":
    main()
