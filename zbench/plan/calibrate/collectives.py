"""Each collective's time against message size over ``ranks`` processes on this machine's backend.

The ranks are spawned processes (``torch.multiprocessing``) joined over TCP on the loopback interface: gloo
with one CPU thread each (a CPU rank is one core, as in a CPU run of zbench), or NCCL with one GPU each.
Sizes grow by factors of 4 from 4 bytes to the device's largest message; each is timed as batches of
back-to-back calls from a barrier, the slowest rank's time of each (``_per_call_seconds``), then fitted
(``zbench.plan.calibrate.fit``); a curve too flat to fit is measured again (``fit_with_retries``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zbench.measure.timing import synchronize
from zbench.plan.calibrate.fit import FitError, fit_alpha_beta
from zbench.plan.simulate.calibration import CollectiveCurve
from zbench.ports import free_port

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# torch 2.14 renamed the tensor forms (the old names warn); the reference engine picks them the same way.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def message_sizes(device_type: str, quick: bool) -> list[int]:
    """Buffer bytes per rank: 4 B to 16 MiB on CPUs (4 MiB quick), to 1 GiB on GPUs, by factors of 4."""
    top = 30 if device_type == "cuda" else (22 if quick else 24)
    return [2**e for e in range(2, top + 1, 2)]


def batches(buffer_bytes: int, quick: bool) -> tuple[int, int]:
    """``(batches, calls per batch)`` for one message size: many calls for latency-bound sizes, few for
    bandwidth-bound ones. Fixed by size, never by a time budget: every rank must issue each collective as often
    as the others, or the group hangs."""
    if buffer_bytes <= 2**20:
        return (3, 5) if quick else (5, 10)
    return (3, 1) if quick else (5, 2)


def ledger_bytes(op: str, buffer_bytes: int, ranks: int) -> int:
    """The bytes the harness's ledger counts for one call on a per-rank buffer of ``buffer_bytes``."""
    if op == "all_reduce":
        return 2 * buffer_bytes
    if op == "all_gather":
        return buffer_bytes * ranks  # the gathered output
    if op == "reduce_scatter":
        return buffer_bytes  # the input, of which each rank keeps 1/ranks
    return buffer_bytes


def _call(op: str, buf: torch.Tensor, ranks: int) -> object:
    if op == "all_reduce":
        return dist.all_reduce(buf)
    if op == "all_gather":
        return _all_gather(buf.new_empty(buf.numel() * ranks), buf)
    if op == "reduce_scatter":
        return _reduce_scatter(buf.new_empty(max(buf.numel() // ranks, 1)), buf)
    return dist.broadcast(buf, src=0)


def _rank(rank: int, ranks: int, port: int, backend: str, quick: bool, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    for op in OPS:  # the first calls of each kind set up connections and buffers: never timed
        for _ in range(2):
            _call(op, torch.ones(ranks * 256, device=device), ranks)
    results: dict[str, list[tuple[int, float]]] = {}
    for op in OPS:
        points = []
        for size in message_sizes(device.type, quick):
            # a multiple of the ranks: a reduce-scatter's input is its output times the ranks
            buf = torch.ones(max(size // 4 // ranks * ranks, ranks), device=device)
            seconds = _per_call_seconds(op, buf, ranks, *batches(size, quick))
            points.append((ledger_bytes(op, buf.numel() * 4, ranks), seconds))
        results[op] = points
    issue = _issue_seconds(device, ranks)
    if rank == 0:
        Path(out).write_text(json.dumps({"points": results, "issue_s": issue}))
    dist.destroy_process_group()


def _per_call_seconds(op: str, buf: torch.Tensor, ranks: int, n_batches: int, calls: int) -> float:
    """The median over ``n_batches`` of one call's share of ``calls`` back-to-back calls started from a barrier,
    each batch taking the slowest rank's time.

    Back to back, as nccl-tests times them: a rank that leaves the barrier late delays the first call of a
    batch only, not every call, and no barrier's own time has to be taken off (on a loaded host the barrier
    varies by more than a small message takes). The slowest rank, because a broadcast's source (and a ring's
    first sender) may return once its sends are queued, before the others have what it sent: one extra
    all-reduce per batch, the same on every rank.
    """
    times = []
    for _ in range(n_batches):
        dist.barrier()
        synchronize(buf.device)
        start = time.perf_counter()
        for _ in range(calls):
            _call(op, buf, ranks)
        synchronize(buf.device)
        elapsed = torch.tensor([(time.perf_counter() - start) / calls], device=buf.device, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed.item()))
    return statistics.median(times)


def _issue_seconds(device: torch.device, ranks: int, calls: int = 200) -> float:
    """Host seconds to issue one asynchronous all-reduce of a small buffer (waited for outside the timing)."""
    buf = torch.ones(ranks, device=device)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        times.append(time.perf_counter() - start)
        work.wait()
    return sorted(times)[len(times) // 2]


#: Spawns of the ranks before a curve that stays flat is reported as noise. Each new spawn can only lower a
#: size's time (``fastest_points``), so a burst of load from other work is outlasted rather than averaged in.
ATTEMPTS = 3

Points = dict[str, list[tuple[int, float]]]


def measure(
    ranks: int, backend: str, *, quick: bool, on_retry: Callable[[str], None] = lambda _: None
) -> tuple[list[CollectiveCurve], float]:
    """Every collective's curve over ``ranks`` ranks, fitted, and the host time to issue one call."""

    def run_once() -> tuple[Points, float]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "collectives.json"
            mp.spawn(_rank, args=(ranks, free_port(), backend, quick, str(out)), nprocs=ranks)
            data = json.loads(out.read_text())
        points = {op: [(int(b), float(s)) for b, s in raw] for op, raw in data["points"].items()}
        return points, float(data["issue_s"])

    return fit_with_retries(run_once, ranks, on_retry=on_retry)


def fit_with_retries(
    run_once: Callable[[], tuple[Points, float]], ranks: int, *, on_retry: Callable[[str], None],
    attempts: int = ATTEMPTS,
) -> tuple[list[CollectiveCurve], float]:  # fmt: skip
    """Fit every curve of ``run_once``'s points; while one is flat (``FitError``: a loaded host's scheduling
    delays swamp the bandwidth term), measure again, up to ``attempts`` in all, keeping each size's fastest
    time. The last attempt's ``FitError`` propagates: the machine stayed too busy to measure."""
    points, issue_s = run_once()
    for attempt in range(2, attempts + 1):
        try:
            return _fit_all(points, ranks), issue_s
        except FitError as exc:
            on_retry(f"{exc}; measuring again ({attempt}/{attempts}), keeping each size's fastest time")
        again, again_issue_s = run_once()
        points, issue_s = fastest_points(points, again), min(issue_s, again_issue_s)
    return _fit_all(points, ranks), issue_s


def fastest_points(first: Points, second: Points) -> Points:
    """Each (op, size)'s lower time of two measurements of the same sizes: noise on a shared host only ever
    adds time (a descheduled rank, a cache another process evicted), so the lower is the nearer the truth."""
    return {op: [(b, min(s1, s2)) for (b, s1), (_, s2) in zip(first[op], second[op], strict=True)] for op in first}


def _fit_all(points: Points, ranks: int) -> list[CollectiveCurve]:
    curves = []
    for op, op_points in points.items():
        latency, bandwidth, error = fit_alpha_beta(op, op_points, ranks)
        curves.append(
            CollectiveCurve(
                op=op, ranks=ranks, latency_us=latency * 1e6, bandwidth_gb_s=bandwidth / 1e9,
                fit_error=error, points=op_points,
            )
        )  # fmt: skip
    return curves
