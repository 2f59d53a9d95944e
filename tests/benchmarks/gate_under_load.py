"""Does the regression gate hold on a loaded machine? Real runs, real load, both gates counted.

One baseline run of a small CPU suite (DDP, zero2 and the ``slow`` test plug-in,
which runs DDP's code), then ``--reruns`` unchanged reruns and as many reruns with the plug-in
slowed by ``--slowdown`` percent, alternating, while a load switcher beside them turns zero, one
or two busy processes on and off every few seconds (a random schedule, seeded). Every rerun is
judged against the baseline twice:

- the gate as it is (``zbench.regress.check``: each case's step time relative to DDP's, from the
  paired rounds measured in the same run; DDP's own drift reported, not gated);
- the gate as it was before the paired rounds: every case's absolute step times, Mann-Whitney U
  and the same minimum effect.

A *false alarm* is any case flagged as a time regression in an unchanged rerun (or a case other
than the slowed one in a slowed rerun); a *detection* is the slowed case flagged in a slowed
rerun. The figures go to docs/methods.md#measured-on-a-loaded-machine.

It takes long (about a minute per run on a 2-core machine), so it is not part of the test run:
``python -m tests.benchmarks.gate_under_load --reruns 20 --out gate.json`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zbench.regress import Thresholds, check, compare_times
from zbench.store import RunDir

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


@dataclass
class Rerun:
    slowed: bool
    paired_flags: list[str] = field(default_factory=list)
    absolute_flags: list[str] = field(default_factory=list)
    slowed_case_change_pct: float | None = None
    rounds: int = 0
    failed_cases: list[str] = field(default_factory=list)

    def counts(self, flags: list[str]) -> tuple[bool, bool]:
        """(false alarm, detection) for one gate's flagged cases."""
        others = [c for c in flags if SLOWED not in c]
        caught = any(SLOWED in c for c in flags)
        if self.slowed:
            return bool(others), caught
        return bool(flags), False


def judge(candidate: RunDir, baseline: RunDir, *, slowed: bool, t: Thresholds) -> Rerun:
    result = check(candidate, baseline, t)
    rerun = Rerun(slowed=slowed)
    rerun.paired_flags = [f.case_id for f in result.findings if f.kind == "regression" and f.metric.startswith("step")]
    rerun.failed_cases = [f.case_id for f in result.findings if f.kind == "failure"]
    rerun.absolute_flags = absolute_time_flags(candidate, baseline, t)
    for case in candidate.cases():
        if SLOWED in case.case_id and case.paired and case.paired.ratios:
            base_case = next(c for c in baseline.cases() if c.case_id == case.case_id)
            if base_case.paired and base_case.paired.ratios:
                rerun.slowed_case_change_pct = 100 * (
                    statistics.median(case.paired.ratios) / statistics.median(base_case.paired.ratios) - 1
                )
            rerun.rounds = len(case.paired.ratios)
    return rerun


def summarise(reruns: list[Rerun]) -> dict[str, object]:
    out: dict[str, object] = {}
    for gate, attr in (("paired (today)", "paired_flags"), ("absolute (before)", "absolute_flags")):
        unchanged = [r.counts(getattr(r, attr)) for r in reruns if not r.slowed]
        slowed = [r.counts(getattr(r, attr)) for r in reruns if r.slowed]
        out[gate] = {
            "unchanged_reruns": len(unchanged),
            "false_alarms_unchanged": sum(fa for fa, _ in unchanged),
            "slowed_reruns": len(slowed),
            "detections": sum(d for _, d in slowed),
            "false_alarms_in_slowed_runs": sum(fa for fa, _ in slowed),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reruns", type=int, default=20, help="unchanged reruns, and as many slowed ones")
    parser.add_argument("--slowdown", type=float, default=10.0, help="percent the slowed reruns add to a step")
    parser.add_argument("--paired-seconds", type=float, default=10.0, help="the suite's paired_seconds")
    parser.add_argument("--seed", type=int, default=0, help="the load schedule's seed")
    parser.add_argument("--out", type=Path, default=None, help="write every rerun and the summary as JSON")
    args = parser.parse_args()

    t = Thresholds()
    with tempfile.TemporaryDirectory(prefix="zbench-gate-") as tmp:
        suite = Path(tmp) / "gate.yaml"
        suite.write_text(SUITE.format(paired_seconds=args.paired_seconds))
        results = Path(tmp) / "results"
        started = time.perf_counter()
        baseline = run_suite(suite, results, slowdown_pct=0)
        print(f"baseline {baseline.run_id} ({time.perf_counter() - started:.0f} s)", flush=True)
        reruns: list[Rerun] = []
        with LoadSwitcher(args.seed) as load:
            for i in range(2 * args.reruns):
                slowed = i % 2 == 1
                candidate = run_suite(suite, results, slowdown_pct=args.slowdown if slowed else 0)
                rerun = judge(candidate, baseline, slowed=slowed, t=t)
                reruns.append(rerun)
                print(
                    f"[{i + 1}/{2 * args.reruns}] {'slowed   ' if slowed else 'unchanged'} "
                    f"paired flags {rerun.paired_flags} absolute flags {rerun.absolute_flags} "
                    f"slowed case {rerun.slowed_case_change_pct and round(rerun.slowed_case_change_pct, 1)}% "
                    f"({rerun.rounds} rounds) failed {rerun.failed_cases} "
                    f"[{time.perf_counter() - started:.0f} s]",
                    flush=True,
                )
        summary = summarise(reruns)
        summary["load_levels_switched"] = len(load.levels)
        print(json.dumps(summary, indent=2))
        if args.out:
            args.out.write_text(json.dumps({"summary": summary, "reruns": [r.__dict__ for r in reruns]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
