"""One process's measurements: matrix products, memory-bound operators, host <-> device copies, module hooks
and the host optimizer step.

The matrix shapes are a transformer layer's: ``tokens x hidden`` activations against ``hidden x hidden``
(attention projections) and ``hidden x 4 hidden`` / ``4 hidden x hidden`` (the MLP) weights, at token counts and
hidden sizes that fit the device (a CPU core runs the small end, a GPU the large), plus one square product that
usually reaches the device's best rate (the profile's peak).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from zbench.errors import OneLineError
from zbench.measure.memory import CPU_MALLOC_ENV
from zbench.plan.calibrate.timer import Timer
from zbench.plan.simulate.calibration import BandwidthPoint, MatmulPoint, dtype_name


@dataclass(frozen=True)
class Sizes:
    """How large the probes are on a device kind; ``quick`` shrinks them for a rough profile in seconds."""

    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    square: int
    dtypes: tuple[torch.dtype, ...]
    stream_bytes: int
    """Host <-> device copies, and the largest memory-bound probe: bytes per tensor."""
    cached_bytes: tuple[int, ...] = ()
    """Smaller memory-bound probes, bytes per tensor: working sets that stay in a CPU's caches, as a training step's
    per-tensor optimizer operators and small activations do."""

    @staticmethod
    def for_device(device: torch.device, *, quick: bool) -> Sizes:
        if device.type == "cuda":
            return Sizes(
                tokens=(2048, 8192), hidden=(1024, 4096, 8192), square=8192,
                dtypes=(torch.bfloat16, torch.float16, torch.float32), stream_bytes=2**30,
            )  # fmt: skip
        if quick:
            return Sizes(tokens=(256,), hidden=(256,), square=512, dtypes=(torch.float32,), stream_bytes=16 * 2**20,
                         cached_bytes=(256 * 2**10, 2**20))  # fmt: skip
        return Sizes(
            tokens=(512, 2048), hidden=(256, 768), square=1024,
            dtypes=(torch.float32, torch.bfloat16), stream_bytes=64 * 2**20,
            cached_bytes=(256 * 2**10, 2**20, 4 * 2**20, 16 * 2**20),
        )  # fmt: skip


def layer_shapes(sizes: Sizes) -> Iterator[tuple[int, int, int]]:
    """``(m, k, n)`` of a transformer layer's products at every size, and the square one."""
    yield sizes.square, sizes.square, sizes.square
    for tokens in sizes.tokens:
        for h in sizes.hidden:
            yield from ((tokens, h, h), (tokens, h, 4 * h), (tokens, 4 * h, h))


#: Seconds a CPU's reduced-precision products may take in all (``matmul_table``): without bf16 instructions they
#: run at 1% of fp32's rate (0.8-1.3 GFLOP/s against 94 on a 2-core AMD EPYC without them, 2026-12-07, whatever
#: the shape), and the table's eleven bf16 shapes took 54 s of a 278-s calibration.
REDUCED_BUDGET_S = 8.0


def matmul_table(timer: Timer, sizes: Sizes, clock: Callable[[], float] = time.perf_counter) -> list[MatmulPoint]:
    """Each layer shape's product in each dtype. On a CPU the reduced precisions run their shapes smallest first,
    and a shape whose calls (the warm-up and ``timer.min_repeats``, at the rate read so far) would take the dtype
    past ``REDUCED_BUDGET_S`` is left out: the simulator charges a larger product the largest measured one's rate
    (``zbench.plan.simulate.compute.flop_rate``). Where the dtype runs at fp32's speed every shape fits."""
    points = []
    for dtype in sizes.dtypes:
        shapes = list(layer_shapes(sizes))
        reduced_on_cpu = dtype != sizes.dtypes[0] and timer.device.type == "cpu"
        if reduced_on_cpu:
            shapes = sorted((s for s in shapes if s[0] * s[1] * s[2] <= 2**31), key=lambda s: s[0] * s[1] * s[2])
        spent, rate = 0.0, math.inf
        for m, k, n in shapes:
            flops = 2 * m * k * n
            if reduced_on_cpu and spent + (timer.min_repeats + 1) * flops / rate > REDUCED_BUDGET_S:
                break
            a = torch.randn(m, k, device=timer.device, dtype=dtype)
            b = torch.randn(k, n, device=timer.device, dtype=dtype)
            started = clock()
            seconds = timer.median_s(partial(torch.matmul, a, b))
            spent += clock() - started
            rate = flops / seconds
            points.append(MatmulPoint(m=m, k=k, n=n, dtype=dtype_name(dtype), tflops=rate / 1e12))
    return points


def memory_bound(timer: Timer, sizes: Sizes) -> list[BandwidthPoint]:
    """``copy_`` (one read, one write) and ``add`` (two reads, one write) of fp32 tensors, at every probed size
    (the simulator charges an operator the bandwidth of its own working set: ``compute.memory_bandwidth``)."""
    points = []
    for nbytes in (*sizes.cached_bytes, sizes.stream_bytes):
        x, y, out = (torch.ones(nbytes // 4, device=timer.device) for _ in range(3))
        copy_s = timer.median_s(partial(out.copy_, x))
        add_s = timer.median_s(partial(torch.add, x, y, out=out))
        points += [
            BandwidthPoint(op="copy", bytes=nbytes, gb_s=2 * nbytes / copy_s / 1e9),
            BandwidthPoint(op="add", bytes=nbytes, gb_s=3 * nbytes / add_s / 1e9),
        ]
    return points


def copies(timer: Timer, sizes: Sizes, memory: list[BandwidthPoint]) -> dict[str, float]:
    """Host <-> device GB/s (bytes copied per second), pinned and pageable; on a CPU there is no device, and the
    host memory copy ``memory_bound`` already timed at its largest size stands in (its figure counts the read and
    the write)."""
    if timer.device.type != "cuda":
        return {"host_copy": max((b for b in memory if b.op == "copy"), key=lambda b: b.bytes).gb_s / 2}
    n = sizes.stream_bytes // 4
    out = {}
    dev = torch.empty(n, device=timer.device)
    for kind, host in (("pinned", torch.empty(n, pin_memory=True)), ("pageable", torch.empty(n))):
        out[f"h2d_{kind}"] = sizes.stream_bytes / timer.median_s(partial(dev.copy_, host)) / 1e9
        out[f"d2h_{kind}"] = sizes.stream_bytes / timer.median_s(partial(host.copy_, dev)) / 1e9
    return out


def mapped_probe(nbytes: int = 4 * 2**20) -> float:
    """GB/s at which this process creates, fills and frees a tensor of ``nbytes`` beyond what filling one it
    already holds costs: the page mapping, zero-filling faults and unmapping of a fresh large block. Meant to run
    in a process whose glibc maps every block of 128 KiB or more (``rank_probes`` starts one)."""
    timer = Timer(torch.device("cpu"), budget_s=0.3)
    n = nbytes // 4
    held = torch.empty(n)
    reuse_s = timer.median_s(lambda: held.fill_(1.0))
    fresh_s = timer.median_s(lambda: torch.empty(n).fill_(1.0))
    return nbytes / max(fresh_s - reuse_s, 1e-9) / 1e9


#: How the rank-environment probe's process marks a progress line on its stderr (everything else there is kept
#: for the error line).
PROGRESS_MARK = "zbench-progress: "


def say_progress(what: str) -> None:
    """A progress line from inside ``rank_probes``'s process, for the calibrating process to show."""
    print(PROGRESS_MARK + what, file=sys.stderr, flush=True)


def rank_probes(quick: bool = False, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """``mapped_probe``, operators inside a training step and their steps' speed-up over every core
    (``zbench.plan.calibrate.in_step.probe``) and the implementations' step overheads
    (``zbench.plan.calibrate.overheads.probe``) as a CPU rank of zbench runs: glibc's mmap
    threshold pinned (``zbench.measure.memory.CPU_MALLOC_ENV``, or the value the user exports, as the launcher
    keeps it). A process of its own, since the threshold is read when the process starts and pinning it here
    would slow the caller's own allocations. Its probes take minutes on a slow host (248 s on a 2-core AMD EPYC
    without bf16 instructions, 2026-12-02), so each one's start is passed to ``progress`` as it happens; the
    result comes back through a file (a pipe would fill while stderr is being read)."""
    env = {**CPU_MALLOC_ENV, **os.environ}
    code = (
        "import json, torch; from zbench.plan.calibrate import in_step, kernels, overheads; "
        "torch.set_num_threads(1); say = kernels.say_progress; print(json.dumps({'mapped_gb_s': "
        f"kernels.mapped_probe(), 'in_step': in_step.probe(quick={quick!r}, threads=kernels.cores(), progress=say), "
        "'overheads': overheads.probe(progress=say)}))"
    )
    last_line = "no output"  # the child's last words, for the error line
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        assert child.stderr is not None
        for line in child.stderr:
            if line.startswith(PROGRESS_MARK):
                progress(line[len(PROGRESS_MARK) :].rstrip())
            elif line.strip():
                last_line = line.strip()
        if child.wait() != 0:
            raise OneLineError(f"the rank-environment probe (fresh pages, threads, host work) failed: {last_line}")
        out.seek(0)
        return json.loads(out.read().strip().splitlines()[-1])


def hook_call_us(calls: int = 2000) -> float:
    """Microseconds one module hook adds to a module call (host time: hooks run on the host whatever the device):
    a tiny module called with and without a forward pre-hook and a forward hook, the difference halved."""
    module, x = nn.Identity(), torch.zeros(1)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
        return (time.perf_counter() - start) / calls

    bare = min(run() for _ in range(3))
    module.register_forward_pre_hook(lambda mod, args: None)
    module.register_forward_hook(lambda mod, args, out: None)
    hooked = min(run() for _ in range(3))
    return max(hooked - bare, 0.0) / 2 * 1e6


def op_call_us(timer: Timer, layers: int = 50, width: int = 16) -> float:
    """Microseconds one operator costs inside a training step when its work is negligible: a step (forward,
    backward, AdamW) of a stack of tiny ``Linear`` + GELU layers, over the operators that step runs (counted by
    the trace's own ledger, ``zbench.plan.trace.ops``).

    Note: a bare one-element ``add`` in a loop costs under 1 us on this machine's CPU, but an operator inside
    a step also pays autograd's graph and saved tensors, module calls and the optimizer's per-tensor loop:
    about 5 us. The first validation charged the bare figure and under-predicted every CPU step (median 58%).
    """
    from zbench.plan.trace.ops import OpLedger

    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))
    model.to(timer.device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, width, device=timer.device)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer's state is created on the first step
    ledger = OpLedger()
    with ledger:
        ledger.start_step()
        step()
        calls = sum(e["count"] for entries in ledger.take().values() for e in entries)
    return timer.median_s(step) / calls * 1e6


def host_adam_params_per_s(threads: int, params: int = 4 * 2**20) -> float:
    """torch's AdamW step on host fp32 tensors, as the offloading engines run it, on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p = nn.Parameter(torch.randn(params))
        p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([p])
        return params / Timer(torch.device("cpu"), budget_s=1.0).median_s(opt.step)
    finally:
        torch.set_num_threads(before)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
