"""Check zbench on one GPU: its steps in priority order, each time-boxed, each one status line with figures.

Run it through ``tools/gpu-check.sh``, which puts the wheels the machine lacks on the path first. Standard library
only, so that it starts on any Python with torch. Every step runs zbench as a user would (``python -m zbench``,
``python -m pytest``) from this checkout, writes its log, and is judged on what it wrote; a step that fails or
runs out of time never stops the next. At the end the folder given as ``--out`` holds at most 8 files:

- ``summary.txt``: one line per step (status, wall time, figures), then the GPU time used;
- ``summary.json``: the same with every figure, which ``--rerun`` reads to run only the steps that did not pass;
- ``logs.tar.gz``: each step's output;
- ``results.tar.gz``: the runs' records and reports, the calibration, the trace and the profiler trace.

The figures are what docs/gpu-check.md records for each GPU it ran on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "suites" / "gpu-check.yaml"
BIG_MODEL = "gpt-1.3b"
#: gpt-1.3b in bf16 without offload, where MFU means something. No fp32 probe (the gpt-125m suite probes every
#: implementation in fp32) and no paired rounds (one GPU, nothing beside it: each case's median is steady enough,
#: and the rounds' DDP copy of a 1.3B model costs seconds to build). On the first H200 run a case took 51 s (30 s of
#: it building, moving and training, the rest saving its parameters for the verdict), so the implementations come
#: in the order their figures matter; cases the box leaves out are named, and ``--rerun`` runs just those.
BIG_SUITE_SETTINGS = [
    f"models=[{BIG_MODEL}]", "precisions=[bf16]", "offload=[none]", "fp32_probe=false", "paired_rounds=0",
    "implementations=[ddp, zero3, fsdp, zero1, zero2, deepspeed, fsdp1, torch_zero]",
]  # fmt: skip
PROFILED_CASE = "gpt-125m-zero3-s3-w1-bf16-none"
GIB = 1024**3


@dataclass
class Context:
    """Where a step writes, how long it may take, and what earlier steps left for later ones."""

    work: Path
    dry_run: bool
    deadline: float
    shared: dict[str, Any] = field(default_factory=dict)
    previous: dict[str, dict] = field(default_factory=dict)
    """Each step's figures in the summary ``--rerun`` read: a suite step runs only the cases it left out there."""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, step: str) -> Path:
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        return self.work / "logs" / f"{step}.log"


@dataclass
class Outcome:
    status: str  # pass | fail | timeout | skipped
    text: str
    figures: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    name: str
    box_s: float
    run: Callable[[Context], Outcome]
    what: str


def zbench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zbench", *args]


def call(cmd: list[str], log: Path, timeout: float, *, stdout: Path | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` with the output in ``log`` (stdout in ``stdout`` where given); ``None`` as the code: timed out."""
    with open(log, "a") as err, open(stdout or log, "a") as out:
        err.write(f"$ {' '.join(cmd)}\n")
        err.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=err, timeout=max(timeout, 1), check=False)
        except subprocess.TimeoutExpired:
            return None, log.read_text()[-2000:]
    return proc.returncode, log.read_text()[-2000:]


def failed(code: int | None, tail: str, box: float) -> Outcome:
    if code is None:
        return Outcome("timeout", f"ran past its {box:.0f} s box")
    last = [line for line in tail.splitlines() if line.strip()][-1:] or ["(no output)"]
    return Outcome("fail", f"exit {code}: {last[0][:200]}")


def run_records(results: Path) -> tuple[list[str], list[dict]]:
    """The newest run under ``results``: the cases it planned (in order) and every case record it stored."""
    runs = sorted(p for p in results.glob("*") if (p / "run.json").is_file())
    if not runs:
        return [], []
    planned = json.loads((runs[-1] / "run.json").read_text()).get("case_order", [])
    return planned, [json.loads(p.read_text()) for p in sorted((runs[-1] / "cases").glob("*.json"))]


def setup(implementation: str, stage: int, offload: str) -> str:
    """``zero3-s3+optimizer``: a case's or a traced row's setup (model, precision and world are the suite's)."""
    return f"{implementation}-s{stage}" + ("" if offload == "none" else f"+{offload}")


def record_setup(record: dict) -> str:
    config = record["config"]
    return setup(config["implementation"], config["stage"], config["offload"])


def case_figures(record: dict) -> dict[str, Any]:
    summary, memory, energy = record.get("summary") or {}, record.get("memory") or {}, record.get("energy") or {}
    return {
        "status": record["status"],
        "equivalent": (record.get("equivalence") or {}).get("equivalent"),
        "step_ms": round(summary["step_time_median_s"] * 1e3, 2) if summary.get("step_time_median_s") else None,
        "ratio_to_ddp": record.get("ratio_to_ddp"),
        "mfu": (record.get("throughput") or {}).get("mfu"),
        # the CUDA allocator's peak (torch.cuda.max_memory_allocated); a CPU run's is the process's RSS: not this
        "allocator_peak_gib": round(memory["peak_bytes"] / GIB, 3) if memory.get("kind") == "cuda_allocated" else None,
        "nvml_peak_gib": round(energy["peak_used_bytes"] / GIB, 3) if energy.get("peak_used_bytes") else None,
        "energy_per_step_j": energy.get("energy_per_step_j"),
        "error": (record.get("error") or "")[:300] or None,
    }


def judge_suite(ctx: Context, name: str, settings: list[str], box: float, select: str | None = None) -> Outcome:
    """``zbench run`` the GPU suite with ``settings`` (only ``select`` and its references, where given, or only
    the cases an earlier run of this step left out); pass when every case ran, ok and equivalent."""
    results, report = ctx.work / f"results-{name}", ctx.work / f"report-{name}"
    earlier = ctx.previous.get(name) or {}
    selects = [select] if select else [*earlier.get("not_run", []), *earlier.get("failed", [])]
    sets = [a for s in settings for a in ("--set", s)] + [a for k in selects for a in ("-k", k)]
    if ctx.dry_run:
        code, tail = call(zbench_cmd("run", str(SUITE), "--dry-run", "--set", "device=auto", *sets), ctx.log(name), box)
        return Outcome("skipped", "dry run: cases listed, none run") if code == 0 else failed(code, tail, box)
    code, tail = call(
        zbench_cmd("run", str(SUITE), "--results", str(results), "--report", str(report), *sets), ctx.log(name), box
    )
    planned, records = run_records(results)
    ran = [r for r in records if r["status"] != "skipped"]
    ctx.shared[name] = ran
    figures: dict[str, object] = {record_setup(r): case_figures(r) for r in ran}
    not_run = [c for c in planned if c not in {r["case_id"] for r in records}]
    figures["not_run"] = not_run
    failures = [r for r in ran if r["status"] != "ok" or (r.get("equivalence") or {}).get("equivalent") is False]
    figures["failed"] = [r["case_id"] for r in failures]
    bad = [record_setup(r) for r in failures]
    text = f"{len(ran) - len(bad)}/{len(ran)} cases ok and equivalent" + (f"; not: {', '.join(bad)}" if bad else "")
    if not_run:
        text += f"; {len(not_run)} not run ({', '.join(not_run[:3])}{', ...' if len(not_run) > 3 else ''})"
    if code is None:
        return Outcome("timeout", f"ran past its {box:.0f} s box; {text}", figures)
    return Outcome("pass" if code == 0 and not bad and ran and not not_run else "fail", text, figures)


def measured_figure(ctx: Context, step: str, figure: str, unit: float) -> dict[str, float]:
    """``figure`` (times ``unit``) of every case that ran ok and equivalent in suite ``step``: from this check's run
    of it, else from the earlier run ``--rerun`` read (a rerun of the trace need not train gpt-1.3b again)."""
    ran = ctx.shared.get(step)
    found = {record_setup(r): case_figures(r) for r in ran} if ran is not None else ctx.previous.get(step, {})
    return {
        name: f[figure] * unit
        for name, f in found.items()
        if isinstance(f, dict) and f.get("status") == "ok" and f.get("equivalent") and f.get(figure) is not None
    }


def step_env(ctx: Context) -> Outcome:
    out = ctx.work / "env.json"
    code, tail = call(zbench_cmd("env", "--json"), ctx.log("env"), 60, stdout=out)
    if code != 0:
        return failed(code, tail, 60)
    info = json.loads(out.read_text())
    figures = {k: info.get(k) for k in ("torch", "cuda_version", "gpus", "gpu_count", "cuda_available", "python")}
    figures["driver"] = (info.get("nvml") or {}).get("driver")
    gpus = info.get("gpus") or ["no GPU"]
    text = f"{gpus[0]} x{info.get('gpu_count', 0)}, torch {info.get('torch')}, driver {figures['driver']}"
    usable = info.get("cuda_available") or ctx.dry_run
    return Outcome("pass" if usable else "fail", text if usable else f"no usable GPU: {text}", figures)


def step_big_suite(ctx: Context) -> Outcome:
    outcome = judge_suite(ctx, "suite-1.3b", BIG_SUITE_SETTINGS, ctx.left())
    if outcome.figures:
        cases = {k: f for k, f in outcome.figures.items() if isinstance(f, dict) and f.get("mfu")}
        mfu = ", ".join(f"{k} {f['mfu']:.0%}" for k, f in cases.items())
        outcome.text += f"; MFU {mfu}" if mfu else ""
    return outcome


def step_tests(ctx: Context) -> Outcome:
    junit = ctx.work / "test_gpu.xml"
    box = ctx.left()  # the step's own box, or what is left of the budget
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    code, tail = call(cmd, ctx.log("tests"), box)
    if not junit.exists():
        return failed(code, tail, box)
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    figures = {"passed": passed, **counts}
    text = f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
    if code is None:
        return Outcome("timeout", text, figures)
    if ctx.dry_run:
        return Outcome("skipped" if passed == 0 and code == 0 else "fail", f"dry run: {text}", figures)
    return Outcome("pass" if code == 0 and passed else "fail", text, figures)


def step_small_suite(ctx: Context) -> Outcome:
    return judge_suite(ctx, "suite-125m", [], ctx.left())


def step_profile(ctx: Context) -> Outcome:
    """One case with a torch.profiler trace of its step 5: are CUDA kernels in it?"""
    settings = ["profile.steps=[5]", "fp32_probe=false", "paired_rounds=0"]
    outcome = judge_suite(ctx, "profile", settings, ctx.left(), select=PROFILED_CASE)
    if ctx.dry_run or outcome.status != "pass":
        return outcome
    traces = sorted((ctx.work / "results-profile").glob(f"*/profiles/{PROFILED_CASE}/*.json*"))
    if not traces:
        return Outcome("fail", f"no trace of {PROFILED_CASE} written", outcome.figures)
    opener = gzip.open if traces[0].suffix == ".gz" else open
    with opener(traces[0], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    text = f"{kernels} CUDA kernels in {traces[0].name} ({traces[0].stat().st_size / 1e6:.1f} MB)"
    return Outcome("pass" if kernels else "fail", text, {"kernels": kernels, "events": len(events)})


# -- the trace runs on fake tensors (CPU only) from the start, beside the GPU steps ------------------------------


def start_trace(ctx: Context) -> None:
    out, log = ctx.work / "trace-1.3b.json", ctx.log("trace")
    cmd = zbench_cmd(
        "plan", "--trace", "--model", BIG_MODEL, "--gpus", "1", "--precision", "bf16", "--micro-batch", "8",
        "--seq-len", "1024", "--device", "auto" if ctx.dry_run else "cuda", "-o", "none", "--json",
    )  # fmt: skip
    with open(log, "w") as err, open(out, "w") as stdout:
        err.write(f"$ {' '.join(cmd)}\n")
        err.flush()
        ctx.shared["trace_proc"] = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=err)


def step_trace(ctx: Context) -> Outcome:
    """Each setup's traced peak on fake cuda against the real allocator peak of the same case at gpt-1.3b."""
    proc = ctx.shared.get("trace_proc")
    if not isinstance(proc, subprocess.Popen):
        start_trace(ctx)
        proc = ctx.shared["trace_proc"]
    assert isinstance(proc, subprocess.Popen)
    try:
        code = proc.wait(timeout=max(ctx.left(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        return Outcome("timeout", "the trace ran past the check's budget")
    if code != 0:
        return failed(code, ctx.log("trace").read_text()[-2000:], 0)
    rows = json.loads((ctx.work / "trace-1.3b.json").read_text())["rows"]
    traced = {
        setup(r["implementation"], r["stage"], r["offload"]): r["trace"]["peak"]["device"]["bytes"]
        for r in rows
        if r.get("trace") and not r["trace"].get("error")
    }
    errors = [r["name"] for r in rows if (r.get("trace") or {}).get("error")]
    measured = measured_figure(ctx, "suite-1.3b", "allocator_peak_gib", GIB)
    figures: dict[str, object] = {
        name: {
            "traced_gib": round(peak / GIB, 3),
            "allocator_gib": round(measured[name] / GIB, 3) if name in measured else None,
            "error": round(peak / measured[name] - 1, 4) if name in measured else None,
        }
        for name, peak in traced.items()
    }
    compared = {k: v["error"] for k, v in figures.items() if isinstance(v, dict) and v["error"] is not None}
    text = f"{len(traced)} setups traced" + (f", {len(errors)} not: {', '.join(errors)}" if errors else "")
    if compared:
        worst = max(compared, key=lambda k: abs(compared[k]))
        text += f"; traced vs allocator peak: worst {worst} {compared[worst]:+.1%}"
    elif not ctx.dry_run:
        text += "; no real peaks to compare (suite-1.3b ran neither here nor in the summary --rerun read)"
    return Outcome("pass" if traced and not errors else "fail", text, figures)


def step_simulate(ctx: Context) -> Outcome:
    """Calibrate this GPU (quick), then predict the gpt-125m offload cases and hold them against their step times."""
    profile = ctx.work / "gpu-profile.yaml"
    nvme = ctx.work / "nvme"
    nvme.mkdir(exist_ok=True)
    log, box = ctx.log("simulate"), ctx.left()
    if not ctx.dry_run:
        cmd = zbench_cmd("calibrate", "--quick", "--base", "h100-sxm", "--nvme-dir", str(nvme), "--out", str(profile))
        code, tail = call(cmd, log, ctx.left())
        if code != 0:
            return failed(code, tail, box)
    out = ctx.work / "simulate-125m.json"
    impls = [a for i in ("zero2", "zero3") for a in ("-i", i)]
    modes = [a for m in ("none", "optimizer", "optimizer+params", "nvme") for a in ("-o", m)]
    cmd = zbench_cmd(
        "plan", "--simulate", "h100-sxm" if ctx.dry_run else str(profile), "--model", "gpt-125m", "--gpus", "1",
        "--scale", "1", "--precision", "bf16", "--micro-batch", "8", "--seq-len", "1024", *impls, *modes, "--json",
    )  # fmt: skip
    code, tail = call(cmd, log, ctx.left(), stdout=out)
    if code != 0:
        return failed(code, tail, box)
    predicted = {
        setup(r["implementation"], r["stage"], r["offload"]): r["estimates"][0]["step_s"]
        for r in json.loads(out.read_text())["rows"]
        if r.get("estimates")
    }
    measured = measured_figure(ctx, "suite-125m", "step_ms", 1e-3)
    figures = {
        k: {"predicted_ms": round(p * 1e3, 2), "measured_ms": round(measured[k] * 1e3, 2) if k in measured else None}
        for k, p in predicted.items()
    }
    errors = {k: p / measured[k] - 1 for k, p in predicted.items() if k in measured}
    if not errors:
        text = f"{len(predicted)} setups predicted; no measured step times to compare (suite-125m ran neither here"
        text += " nor in the summary --rerun read)"
        return Outcome("skipped" if ctx.dry_run else "fail", text, figures)
    offload = {k: e for k, e in errors.items() if "+" in k}
    median = sorted(abs(e) for e in errors.values())[len(errors) // 2]
    text = f"{len(errors)} setups, |error| median {median:.0%}; offload: " + ", ".join(
        f"{k} {e:+.0%}" for k, e in sorted(offload.items())
    )
    return Outcome("pass", text, figures)


STEPS = [
    Step("env", 60, step_env, "zbench env: the GPU, torch, CUDA, the nvml driver"),
    Step("suite-1.3b", 150, step_big_suite, f"{BIG_MODEL} bf16, every implementation, world 1: MFU, ratios, peaks"),
    Step("tests", 240, step_tests, "pytest tests/test_gpu.py"),
    Step("suite-125m", 180, step_small_suite, "gpt-125m bf16 (fp32 probes) x every offload mode each supports"),
    Step("profile", 90, step_profile, f"{PROFILED_CASE} with a torch.profiler trace of step 5"),
    Step("trace", 60, step_trace, f"plan --trace on fake cuda at {BIG_MODEL} against each real allocator peak"),
    Step("simulate", 90, step_simulate, "calibrate --quick, then gpt-125m offload step times against the simulator"),
]


#: What comes back from a lent GPU machine: at most 16 MiB a file (docs/gpu-check.md); a bundle is kept under it.
BUNDLE_LIMIT = 15 * 1024**2
#: Seconds of the budget kept for the bundles (a second-long tar of logs and records, minus the parameters).
BUNDLE_RESERVE_S = 15


def bundle(work: Path, out: Path) -> list[str]:
    """``logs.tar.gz`` and ``results.tar.gz`` in ``out``, without the parameter files (GBs at gpt-1.3b, read
    already by the verdicts) and the NVMe swap; the largest files go until a bundle is under the limit, named."""
    left_out: list[str] = []
    results = [p for p in sorted(work.iterdir()) if p.name not in {"logs", "nvme"}]
    for name, paths in (("logs", [work / "logs"]), ("results", results)):
        found = (f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))))
        files = sorted((f for f in found if f.is_file() and f.suffix != ".pt"), key=lambda f: f.stat().st_size)
        while True:
            with tarfile.open(out / f"{name}.tar.gz", "w:gz") as tar:
                for f in files:
                    tar.add(f, arcname=str(f.relative_to(work)))
            if (out / f"{name}.tar.gz").stat().st_size <= BUNDLE_LIMIT or not files:
                break
            largest = files.pop()
            left_out.append(f"{largest.relative_to(work)} ({largest.stat().st_size / 1e6:.1f} MB)")
    return left_out


def steps_to_run(steps: str | None, rerun: Path | None) -> tuple[set[str], dict[str, dict]]:
    """The steps named (default: all), or those that did not pass in an earlier ``summary.json``, with every step's
    figures there (a suite step then runs only the cases it left out or failed, and the trace and simulate steps
    compare with the cases measured there); ValueError for a step that does not exist."""
    names = [s.name for s in STEPS]
    chosen, previous = (set(steps.split(",")) if steps else set(names)), {}
    if rerun:
        try:
            earlier = json.loads(rerun.read_text())["steps"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"--rerun {rerun}: not a summary.json the check wrote ({type(exc).__name__}: {exc})"
            ) from None
        chosen = {s["name"] for s in earlier if s["status"] != "pass"}
        previous = {s["name"]: s["figures"] for s in earlier}
    if unknown := chosen - set(names):
        raise ValueError(f"unknown step(s) {', '.join(sorted(unknown))}; the steps: {', '.join(names)}")
    return chosen, previous


def main(argv: list[str] | None = None) -> int:
    steps = "\n".join(f"  {s.name:<11} {s.box_s:4.0f} s  {s.what}" for s in STEPS)
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"steps, in the order they run (each with its box):\n{steps}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the (at most 8) result files")
    parser.add_argument("--budget", type=float, default=300, help="seconds for the whole check (default 300)")
    parser.add_argument("--steps", help=f"comma-separated steps to run (of {', '.join(s.name for s in STEPS)})")
    parser.add_argument("--rerun", type=Path, help="a summary.json: run only the steps that did not pass there")
    parser.add_argument("--dry-run", action="store_true", help="run only what a machine without a GPU can")
    args = parser.parse_args(argv)
    try:
        chosen, previous = steps_to_run(args.steps, args.rerun)
    except ValueError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zbench-gpu-check-"))
    start = time.monotonic()
    ctx = Context(work, args.dry_run, start + args.budget - BUNDLE_RESERVE_S, previous=previous)
    if "trace" in chosen:
        start_trace(ctx)  # CPU only: beside the GPU steps from the start
    lines, records = [], []
    for step in STEPS:
        if step.name not in chosen:
            continue
        t0 = time.monotonic()
        if ctx.left() < 5:
            outcome = Outcome("skipped", "the check's budget was spent")
        else:
            inner = Context(work, args.dry_run, min(ctx.deadline, t0 + step.box_s), ctx.shared, previous)
            try:
                outcome = step.run(inner)
            except Exception as exc:  # a fault in reading a step's output is that step's failure, not the check's
                outcome = Outcome("fail", f"{type(exc).__name__}: {exc}"[:300])
        wall = time.monotonic() - t0
        line = f"{step.name:<11} {outcome.status:<8} {wall:6.1f} s  {outcome.text}"
        print(line, flush=True)
        lines.append(line)
        records.append({"name": step.name, "status": outcome.status, "wall_s": round(wall, 1), "text": outcome.text,
                        "figures": outcome.figures})  # fmt: skip
    trace = ctx.shared.get("trace_proc")
    if isinstance(trace, subprocess.Popen) and trace.poll() is None:
        trace.kill()  # its step never came (the budget): it must not outlive the check
    left_out = bundle(work, args.out)
    total = time.monotonic() - start
    lines.append(f"total {total:.0f} s of a {args.budget:.0f} s budget; work folder {work}")
    if left_out:
        lines.append(f"left out of the bundles (over {BUNDLE_LIMIT // 1024**2} MiB): {', '.join(left_out)}")
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    summary = {"created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": args.dry_run,
               "total_s": round(total, 1), "left_out": left_out, "steps": records}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n".join(lines[len(records) :]))
    return 0 if all(r["status"] in {"pass", "skipped"} for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
