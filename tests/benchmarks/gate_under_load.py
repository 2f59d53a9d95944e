"""Does the regression gate hold on a loaded machine? Real runs, real load, every gate counted.

A small CPU suite (DDP, zero2 and the ``slow`` test plug-in, which runs DDP's code) runs
``--baseline-runs`` times before a load switcher starts and as many times beside it: the two
candidate baselines. Then ``--reruns`` unchanged reruns and as many with the plug-in slowed by
``--slowdown`` percent, alternating, beside the switcher, which turns zero, one or two busy
processes on and off every 2-8 s (a random schedule, seeded). Every run is kept under ``--keep``
with a manifest, and every rerun is judged by each gate in ``GATES``:

- today's gate (``zbench.verdicts.regress.check``): each case's step time relative to DDP's, from the paired
  rounds measured in the same run, against the pooled baseline runs, with an allowance widened by
  how far those runs' medians spread; DDP's own drift reported, not gated;
- the same against the pooled runs made before the load;
- the gate before pooling: paired ratios against one baseline run;
- the gate before paired rounds: every case's absolute step times against one baseline run.

A *false alarm* is any case flagged as a time regression in an unchanged rerun (or a case other
than the slowed one in a slowed rerun); a *detection* is the slowed case flagged in a slowed
rerun. The figures go to docs/methods.md#measured-on-a-loaded-machine.

It takes long (about a minute per run on a 2-core machine), so it is not part of the test run:
``python -m tests.benchmarks.gate_under_load --keep /tmp/gate --out gate.json`` from the repository
root; ``--judge-only`` judges kept runs again (after changing a gate).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zbench.results.store import RunDir
from zbench.verdicts.regress import Thresholds, check, compare_times

REPO = Path(__file__).resolve().parents[2]
SLOWED = "FAULTY"
"""The case id fragment of the plug-in that the slowed reruns slow down."""

SUITE = """
name: gate-under-load
device: cpu
models: tiny
world_sizes: 2
precisions: fp32
steps: 12
warmup_steps: 2
noise_twin: false
implementations: [ddp, zero2, {{name: "tests.plugins.faulty:FAULTY", options: {{fault: slow}}}}]
paired_rounds: 20
paired_seconds: {paired_seconds}
timeout_s: 300
"""


class LoadSwitcher:
    """Zero, one or two busy processes, switched every 2-8 s on a seeded random schedule."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.hogs: list[subprocess.Popen[bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.levels: list[int] = []

    def _set(self, n: int) -> None:
        while len(self.hogs) > n:
            self.hogs.pop().kill()
        while len(self.hogs) < n:
            self.hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        self.levels.append(n)

    def _run(self) -> None:
        while not self.stop.is_set():
            self._set(self.rng.choice((0, 1, 2)))
            self.stop.wait(self.rng.uniform(2, 8))
        self._set(0)

    def __enter__(self) -> LoadSwitcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def run_suite(suite: Path, results: Path, *, slowdown_pct: float) -> RunDir:
    """``zbench run`` in a subprocess, as a user runs it; the newest run directory it wrote."""
    env = {**os.environ, "ZBENCH_TEST_SLOWDOWN_PCT": str(slowdown_pct), "PYTHONPATH": str(REPO)}
    env.pop("ZBENCH_HEARTBEAT_S", None)
    before = set(results.iterdir()) if results.exists() else set()
    proc = subprocess.run(
        [sys.executable, "-m", "zbench", "run", str(suite), "--results", str(results), "--report", str(results / "_r")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"zbench run exited {proc.returncode}: {proc.stderr[-2000:]}")
    (new,) = [p for p in results.iterdir() if p not in before and p.name != "_r"]
    return RunDir(results, new.name)


def absolute_time_flags(candidate: RunDir, baseline: RunDir, t: Thresholds) -> list[str]:
    """The gate before paired rounds: every case (DDP included) on its absolute per-step times."""
    base = {c.case_id: c for c in baseline.cases()}
    flagged = []
    for cand in candidate.cases():
        b = base.get(cand.case_id)
        if not (cand.ok and b is not None and b.ok):
            continue
        kind, _, _ = compare_times(b.timed_step_times(), cand.timed_step_times(), t)
        if kind == "regression":
            flagged.append(cand.case_id)
    return flagged


def time_flags(candidate: RunDir, baselines: list[RunDir], t: Thresholds) -> list[str]:
    """Cases ``zbench check`` flags as time regressions against these baseline runs (newest first)."""
    result = check(candidate, baselines, t)
    failed = [f.case_id for f in result.findings if f.kind == "failure"]
    if failed:
        raise RuntimeError(f"{candidate.run_id}: cases failed outright: {failed}")
    return [f.case_id for f in result.findings if f.kind == "regression" and f.metric.startswith("step")]


@dataclass
class Baselines:
    quiet: list[RunDir]
    """Made before the load switcher started (other work may still have run on the machine), newest first."""
    loaded: list[RunDir]
    """Made beside the switched load, newest first."""


GATES: dict[str, Callable[[RunDir, Baselines, Thresholds], list[str]]] = {
    "pooled, 5 baseline runs beside the load (today)": lambda run, b, t: time_flags(run, b.loaded, t),
    "pooled, 5 baseline runs before the load": lambda run, b, t: time_flags(run, b.quiet, t),
    "paired, 1 baseline run before the load (the gate before pooling)": lambda run, b, t: time_flags(
        run, b.quiet[:1], t
    ),
    "absolute times, 1 baseline run before the load (before paired rounds)": lambda run, b, t: absolute_time_flags(
        run, b.quiet[0], t
    ),
}


def median_ratios(run: RunDir) -> dict[str, float]:
    """Each case's median paired ratio in one run: the figure the gate compares."""
    return {
        c.case_id: round(statistics.median(c.paired.ratios), 4)
        for c in run.cases()
        if c.ok and c.paired and c.paired.ratios
    }


def judge_all(keep: Path) -> dict[str, object]:
    """Every rerun under ``keep`` judged by every gate in ``GATES``; false alarms and detections per gate."""
    manifest = json.loads((keep / "manifest.json").read_text())

    def runs(kind: str) -> list[RunDir]:
        return [RunDir(keep / "results", run_id) for run_id in manifest[kind]]

    base = Baselines(quiet=runs("quiet_baselines")[::-1], loaded=runs("loaded_baselines")[::-1])
    t = Thresholds()
    rows: list[dict[str, Any]] = []
    for kind in ("unchanged", "slowed"):
        for run in runs(kind):
            flags = {gate: how(run, base, t) for gate, how in GATES.items()}
            rows.append({"run": run.run_id, "slowed": kind == "slowed", "flags": flags, "ratios": median_ratios(run)})
    summary: dict[str, object] = {}
    for gate in GATES:
        unchanged = [r["flags"][gate] for r in rows if not r["slowed"]]
        slowed = [r["flags"][gate] for r in rows if r["slowed"]]
        summary[gate] = {
            "unchanged_reruns": len(unchanged),
            "false_alarms_unchanged": sum(bool(f) for f in unchanged),
            "slowed_reruns": len(slowed),
            "detections": sum(any(SLOWED in c for c in f) for f in slowed),
            "false_alarms_in_slowed_runs": sum(any(SLOWED not in c for c in f) for f in slowed),
        }
    summary["time_allowance_pct (pooled beside the load)"] = check(
        runs("unchanged")[0], base.loaded, t
    ).time_allowance_pct
    summary["baseline median ratios"] = {
        "before the load": [median_ratios(r) for r in base.quiet],
        "beside the load": [median_ratios(r) for r in base.loaded],
    }
    return {"summary": summary, "reruns": rows}


def collect(args: argparse.Namespace) -> None:
    """Make every run and keep it: ``--keep DIR`` holds the run directories and ``manifest.json`` (which is which)."""
    keep: Path = args.keep
    keep.mkdir(parents=True, exist_ok=True)
    suite = keep / "gate.yaml"
    suite.write_text(SUITE.format(paired_seconds=args.paired_seconds))
    results = keep / "results"
    manifest: dict[str, list[str]] = {"quiet_baselines": [], "loaded_baselines": [], "unchanged": [], "slowed": []}
    started = time.perf_counter()

    def one(kind: str, slowdown: float) -> None:
        run = run_suite(suite, results, slowdown_pct=slowdown)
        manifest[kind].append(run.run_id)
        (keep / "manifest.json").write_text(json.dumps(manifest, indent=1))
        done = sum(len(v) for v in manifest.values())
        print(f"[{done}] {kind} {run.run_id} [{time.perf_counter() - started:.0f} s]", flush=True)

    for _ in range(args.baseline_runs):
        one("quiet_baselines", 0)
    with LoadSwitcher(args.seed) as load:
        for _ in range(args.baseline_runs):
            one("loaded_baselines", 0)
        for i in range(2 * args.reruns):
            one("slowed" if i % 2 else "unchanged", args.slowdown if i % 2 else 0)
    print(f"{len(load.levels)} load switches", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reruns", type=int, default=20, help="unchanged reruns, and as many slowed ones")
    parser.add_argument("--baseline-runs", type=int, default=5, help="baseline runs without load, then as many with")
    parser.add_argument("--slowdown", type=float, default=10.0, help="percent the slowed reruns add to a step")
    parser.add_argument("--paired-seconds", type=float, default=10.0, help="the suite's paired_seconds")
    parser.add_argument("--seed", type=int, default=0, help="the load schedule's seed")
    parser.add_argument("--keep", type=Path, required=True, help="directory for the runs and the manifest")
    parser.add_argument("--judge-only", action="store_true", help="judge the runs already in --keep")
    parser.add_argument("--out", type=Path, default=None, help="write every verdict and the summary as JSON")
    args = parser.parse_args()
    if not args.judge_only:
        collect(args)
    summary = judge_all(args.keep)
    print(json.dumps(summary["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
