"""Shared fixtures: the zbench CLI run as a real subprocess, and suite files written to tmp dirs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CLIResult:
    returncode: int
    stdout: str
    stderr: str


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this checkout first on PYTHONPATH, the caller's path kept after it."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def cpu_runs_bf16_natively() -> bool:
    """Whether this CPU has the instructions oneDNN's bf16 matmuls need (AVX-512 or AVX-NE-CONVERT); without them
    torch emulates bf16, 16x slower than fp32 on a 2-core AMD EPYC with AVX2 only (2026-12-02)."""
    import torch

    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def trace_test_precision() -> str:
    """The precision of tests/test_trace.py's real traces: bf16 where the CPU runs it natively, fp32 where it
    emulates it (there the real traces took past the group's 600 s limit: CI on a 2-core AMD EPYC with AVX2 only,
    2026-12-02; 265 s in all on a native host). ``ZBENCH_TRACE_TEST_PRECISION`` picks one."""
    return os.environ.get("ZBENCH_TRACE_TEST_PRECISION") or ("bf16" if cpu_runs_bf16_natively() else "fp32")


def pytest_report_header() -> str:
    native = "native" if cpu_runs_bf16_natively() else "emulated"
    return f"bf16 on this CPU: {native}; test_trace's real traces run in {trace_test_precision()}"


def is_rank_process(pid: int) -> bool:
    """Whether ``pid`` is a live zbench rank, forked from the fork server (named ``zbench-rank``) or started as
    ``python -m zbench.worker``."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (
            proc.name() == "zbench-rank" or "zbench.worker" in " ".join(proc.cmdline())
        )
    except psutil.Error:  # gone
        return False


def zbench(*args: str, cwd: Path = ROOT, timeout: float = 600, env: dict[str, str] | None = None) -> CLIResult:
    """Run ``python -m zbench ARGS`` the way a user would (a fresh process, real files), with ``env`` added to its
    environment."""
    env = child_env(COLUMNS="200", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "zbench", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return CLIResult(proc.returncode, proc.stdout, proc.stderr)


def zbench_many(arg_lists: list[list[str]], cwd: Path = ROOT, timeout: float = 300) -> list[CLIResult]:
    """Run several CLI invocations, a few at a time (each pays torch's import; a few overlap it well on any
    machine). All at once, seventy torch imports fought over two cores and memory, and on a loaded machine the
    later ones ran past their timeouts."""
    from concurrent.futures import ThreadPoolExecutor

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # the fast tier's other worker runs its own
    at_once = max(2, max(4, os.cpu_count() or 4) // workers)
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(lambda args: zbench(*args, cwd=cwd, timeout=timeout), arg_lists))


#: gloo's TCP transport aborting a rank on a message of another collective's size: seen now and then at world 4 on
#: two cores in FSDP2's repeated real runs (tests/test_trace.py), the same group passing when launched again. A group
#: that fails this way is launched once more, and says so; any other failure fails at once.
GLOO_SIZE_MISMATCH = "Received data size doesn't match expected size"


def _launch_group(script: str, world: int, out: Path) -> list[subprocess.Popen]:
    out.mkdir()
    env = child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return [
        subprocess.Popen(
            [sys.executable, script, str(world), str(rank), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for rank in range(world)
    ]


def launch_rank_scripts(script: str, worlds: tuple[int, ...], base: Path, *, label: str) -> dict[int, dict[int, dict]]:
    """Launch ``python SCRIPT WORLD RANK OUTDIR`` for every rank of every world size at once (one process group
    each), wait, and load each rank's ``rank<R>.pt``; a failed group fails the calling test with its ranks' logs
    (one that gloo aborted on a mismatched message size is launched once more first: ``GLOO_SIZE_MISMATCH``)."""
    import torch

    start = time.perf_counter()
    procs = {world: _launch_group(script, world, base / f"world{world}") for world in worlds}
    results, failures = {}, []
    for world, ranks in procs.items():
        out = base / f"world{world}"
        logs = [p.communicate(timeout=600)[0] for p in ranks]
        if any(p.returncode for p in ranks) and any(GLOO_SIZE_MISMATCH in log for log in logs):
            print(f"{label}: world {world}: gloo aborted on a mismatched message size; launching the group again")
            out = base / f"world{world}-again"
            ranks = _launch_group(script, world, out)
            logs = [p.communicate(timeout=600)[0] for p in ranks]
        files = [out / f"rank{r}.pt" for r in range(world)]
        if any(p.returncode for p in ranks) or not all(f.exists() for f in files):
            failures.append(
                f"world {world}: exit codes {[p.returncode for p in ranks]}\n" + "\n".join(log[-3000:] for log in logs)
            )
            continue
        results[world] = {r: torch.load(f, weights_only=True) for r, f in enumerate(files)}
    print(f"{label}: {time.perf_counter() - start:.1f}s")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    return results


def hand_back_and_exit(results: dict, out: Path, rank: int) -> None:
    """The end of a rank script: write ``rank<R>.pt`` atomically for ``launch_rank_scripts``, wait for the group, exit.

    Note: interpreter teardown is skipped; gloo's threads can abort a process at exit after all is written.
    """
    import torch
    import torch.distributed as dist

    torch.save(results, out / f"rank{rank}.pt.tmp")
    os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="session")
def cli():
    return zbench


def make_case(**overrides: object):
    """A valid ``Case`` without a suite (tiny GPT, DDP, world 2, CPU); ``overrides`` replace fields."""
    from zbench.cases.case import Case

    fields: dict[str, object] = dict(
        model="tiny", implementation="ddp", stage=0, world_size=2, precision="fp32", offload="none", device="cpu",
        steps=10, warmup_steps=0, micro_batch=4, grad_accum=1, seq_len=32, seed=0, timeout_s=60.0,
        optimizer="adamw", lr=1e-3, weight_decay=0.0, momentum=0.0, grad_clip=None,
    )  # fmt: skip
    return Case.model_validate({**fields, **overrides})


@pytest.fixture(scope="session", autouse=True)
def the_checkout_stays_clean():
    """No test writes a report or results into the checkout: each passes ``--report``/``--results`` under tmp.
    (One that did not left generated pages in ``reports/``, which were then committed by mistake.)"""

    def generated() -> set[Path]:
        return {p for d in ("reports", "results") if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*")}

    before = generated()
    yield
    written = sorted(str(p.relative_to(ROOT)) for p in generated() - before)
    assert not written, f"tests wrote into the checkout: {written[:10]}"
