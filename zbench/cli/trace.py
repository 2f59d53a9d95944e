"""``zbench plan --trace`` and ``--simulate``: the implementations' real code on fake tensors at the user's scale,
printed next to the formulas, or turned into predicted step times on a cluster profile.

Note: tracing a large model takes minutes per implementation, so progress and a heartbeat go to stderr whatever
the output format (stdout stays one JSON document with ``--json``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from zbench.cli.options import stderr, stdout
from zbench.errors import UsageError
from zbench.values import OFFLOAD_MODES, Precision

if TYPE_CHECKING:
    from zbench.cases.case import Case
    from zbench.plan.simulate.cluster import Cluster
    from zbench.plan.trace.plan import TracedRow


@dataclass(frozen=True, kw_only=True)
class TraceRequest:
    """What ``zbench plan --trace/--simulate`` was asked, as typed on the command line."""

    model: str
    gpus: int
    precision: Precision
    implementations: list[str] | None
    offloads: list[str] | None
    micro_batch: int
    seq_len: int | None
    checkpointing: bool
    options: dict[str, object]
    device: str
    gpu_memory: float | None
    gpus_per_node: int | None
    as_json: bool
    simulate: str | None = None
    scales: list[int] | None = None


def plan_trace(req: TraceRequest) -> None:
    """Trace, then print the table (or JSON); with ``simulate``, the step-time sweep."""
    from zbench.plan.trace import plan as trace_mod

    dev = trace_device(req.device)
    cases = _cases(req, dev)
    cluster = _cluster(req) if req.simulate is not None else None
    rows = trace_mod.trace_plan(cases, device=dev, progress=trace_mod.stderr_progress)
    if cluster is not None:
        _print_simulation(rows, cluster, req)
    elif req.as_json:
        _print_trace_json(rows, req, dev, cases[0].seq_len)
    else:
        _print_trace_table(rows, req, dev, cases[0].seq_len)


def trace_device(device: str) -> str:
    """``--device``: the fake tensors' device (``auto`` resolved), or one line where fake cuda cannot trace here."""
    from zbench.plan.trace import plan as trace_mod

    dev = trace_mod.default_device() if device == "auto" else device
    if dev == "cuda" and (why := trace_mod.why_not_cuda()):
        raise UsageError(f"--device cuda: {why}; trace with --device cpu")
    return dev


def checked_implementations(given: list[str] | None) -> list[str]:
    """``--implementation``'s names (default: every built-in), or one line naming the unknown ones."""
    from zbench.implementations import BUILTIN

    names = list(given or BUILTIN)
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise UsageError(f"--implementation: unknown {', '.join(unknown)}; built-in: {', '.join(BUILTIN)}")
    return names


def checked_offloads(given: list[str] | None) -> None:
    """One line for an ``--offload`` mode that does not exist."""
    bad = [o for o in given or () if o not in OFFLOAD_MODES]
    if bad:
        raise UsageError(f"--offload: unknown {', '.join(bad)}; allowed: {', '.join(OFFLOAD_MODES)}")


def _cases(req: TraceRequest, dev: str) -> list[Case]:
    """One case per implementation x stage x offload mode asked for that can be traced on ``dev``."""
    from zbench.cases.model_source import model_info
    from zbench.plan.trace import plan as trace_mod

    names = checked_implementations(req.implementations)
    info = model_info(req.model)  # checked by the command
    seq = req.seq_len or info.default_seq_len
    if req.micro_batch < 1 or not 1 <= seq <= info.seq:
        raise UsageError(f"--micro-batch must be >= 1 and --seq-len in 1..{info.seq}")
    checked_offloads(req.offloads)
    skipped = trace_mod.untraceable(names)
    if len(skipped) == len(set(names)):
        raise UsageError(f"--implementation: nothing to trace: {'; '.join(f'{n}: {r}' for n, r in skipped.items())}")
    for name, reason in skipped.items():
        print(f"{name}: not traced: {reason}", file=sys.stderr)
    combos = trace_mod.combinations(names, req.offloads or OFFLOAD_MODES, dev)
    if not combos:
        raise UsageError(f"nothing to trace: no implementation given runs the offload modes given on {dev}")
    for n, s, o in trace_mod.combinations(names, req.offloads or OFFLOAD_MODES):
        if (n, s, o) not in combos:
            print(f"{n} (stage {s}) + offload {o}: not traced, its offload needs another device than {dev}",
                  file=sys.stderr)  # fmt: skip
    make = partial(
        trace_mod.make_case, gpus=req.gpus, precision=req.precision, micro_batch=req.micro_batch, seq_len=seq,
        device=dev, checkpointing=req.checkpointing,
    )  # fmt: skip
    if untaken := trace_mod.untaken_option(names, req.options):
        raise UsageError(untaken)
    return [make(req.model, n, s, o, options=trace_mod.taken_options(n, req.options)) for n, s, o in combos]


def _cluster(req: TraceRequest) -> Cluster:
    from zbench.plan.simulate.cluster import ClusterError, load

    try:
        cluster = load(req.simulate or "")
    except ClusterError as exc:
        raise UsageError(f"--simulate: {exc}") from None
    if any(n < 1 for n in req.scales or ()):
        raise UsageError("--scale: world sizes must be positive")
    return cluster


def _print_trace_json(rows: list[TracedRow], req: TraceRequest, dev: str, seq: int) -> None:
    document = {
        "model": req.model,
        "gpus": req.gpus,
        "precision": req.precision,
        "device": dev,
        "micro_batch": req.micro_batch,
        "seq_len": seq,
        "gpu_memory_gib": req.gpu_memory,
        "gpus_per_node": req.gpus_per_node or req.gpus,
        "rows": [r.to_json() for r in rows],
    }
    print(json.dumps(document, indent=1))


TRACE_COLUMNS = (
    "implementation",
    "states on GPU",
    "formula",
    "host per rank",
    "formula ",
    "disk",
    "peak on GPU",
    "largest share of the peak",
    "sent per step",
    "host per node",
    "fits",
)


def _print_trace_table(rows: list[TracedRow], req: TraceRequest, dev: str, seq: int) -> None:
    """Rank 0's traced bytes next to the formulas, one row per implementation; differences explained on stderr."""
    table = Table(
        title=f"{req.model} traced as rank 0 of {req.gpus} ({dev} fake tensors), {req.precision}, micro-batch "
        f"{req.micro_batch} x {seq} tokens" + (f", {req.gpu_memory:g} GiB per GPU" if req.gpu_memory else "")
    )
    for col in TRACE_COLUMNS:
        table.add_column(col, justify="left" if col in ("implementation", "largest share of the peak") else "right")
    notes = []
    for r in rows:
        if r.trace.error:
            table.add_row(r.name, "cannot trace", "", "", "", "", "", r.trace.error[:60], "", "", "-")
            notes.append(f"{r.name}: {r.trace.error}")
            continue
        table.add_row(*_trace_cells(r, req))
        notes += [f"{r.name}: {line}" for line in r.differences]
    stdout().print(table)
    err = stderr()
    if dev == "cpu":
        err.print(
            Text(
                "traced on fake CPU tensors: 'GPU' is the compute device; host copies of offloaded state share "
                "its memory on this stand-in, so the peak shown is the live peak less the host-held state and buffers "
                "(host temporaries still count; docs/methods.md#tracing)"
            )
        )
    for line in notes:
        err.print(Text(line))


def _trace_cells(r: TracedRow, req: TraceRequest) -> list[str]:
    from zbench.plan.trace.live import HELD
    from zbench.results.formatting import fmt_bytes

    roles = dict(r.trace.peak.get("device", {}).get("roles", {}))
    host_held = int(r.host_held_in_peak())
    if host_held and HELD in roles:
        roles[HELD] = max(0, roles[HELD] - host_held)
    top = max(roles, key=lambda role: roles[role]) if roles else "-"
    peak = r.peak("device") - host_held
    limit = req.gpu_memory * 2**30 if req.gpu_memory else None
    return [
        r.name,
        fmt_bytes(r.located("device")),
        fmt_bytes(r.located("device", "formula")),
        fmt_bytes(r.located("host")),
        fmt_bytes(r.located("host", "formula")),
        fmt_bytes(r.located("disk")),
        fmt_bytes(peak),
        f"{top} {roles.get(top, 0) / peak:.0%}" if peak else "-",
        fmt_bytes(r.trace.comm_bytes),
        fmt_bytes(r.host_held() * (req.gpus_per_node or req.gpus)),
        "-" if limit is None else ("yes" if peak <= limit else "NO"),
    ]


def _print_simulation(rows: list[TracedRow], cluster: Cluster, req: TraceRequest) -> None:
    """The ``--simulate`` sweep: tokens/s per GPU at each world size, then the detail at ``--gpus``."""
    from zbench.plan.simulate.sweep import DEFAULT_SCALES, MEASURED_ERROR, simulate

    gpus = req.gpus
    worlds = sorted(set(req.scales or DEFAULT_SCALES) | {gpus})
    sims = simulate(rows, cluster, worlds)
    if req.as_json:
        document = {
            "model": req.model,
            "cluster": cluster.model_dump(),
            "measured_error": MEASURED_ERROR[cluster.compute_model()],
            "rows": [r.to_json() for r in sims],
        }
        print(json.dumps(document, indent=1))
        return
    sweep = Table(title=f"{req.model} on {cluster.description or cluster.name}: predicted tokens/s per GPU")
    sweep.add_column("implementation")
    for w in worlds:
        sweep.add_column(f"{w} GPUs", justify="right")
    model = cluster.compute_model()
    how = {
        "calibrated": "compute: each traced operator at its calibrated cost",
        "datasheet": "compute: each traced operator at the datasheet's operator rates",
        "efficiency": f"{cluster.efficiency:.0%} of {cluster.peak_tflops:g} TFLOP/s assumed",
    }[model]
    detail = Table(title=f"at {gpus} GPUs ({how})")
    for col in ("implementation", "step", "compute", "exposed comm", "offload", "MFU", "comm / compute"):
        detail.add_column(col, justify="left" if col == "implementation" else "right")
    notes = []
    for sim in sims:
        if not sim.estimates:
            sweep.add_row(sim.name, *["cannot trace"] * len(worlds))
            continue
        sweep.add_row(sim.name, *[f"{e.tokens_per_s_per_gpu:,.0f}" for e in sim.estimates])
        e = next(e for e in sim.estimates if e.world == gpus)
        detail.add_row(
            sim.name, f"{e.step_s * 1e3:,.0f} ms", f"{e.compute_s * 1e3:,.0f} ms", f"{e.exposed_comm_s * 1e3:,.0f} ms",
            f"{e.offload_s * 1e3:,.0f} ms", f"{e.mfu:.0%}", f"{e.comm_to_compute:.2f}",
        )  # fmt: skip
        stop = sim.first_exposed()
        if stop is not None and cluster.overlap > 0:
            notes.append(f"{sim.name}: communication stops hiding behind compute at {stop} GPUs")
    if cluster.overlap == 0:
        notes.append(f"{cluster.name}: overlap 0, so no communication is assumed hidden behind compute")
    notes.append(MEASURED_ERROR[model])
    out = stdout()
    for table in (sweep, detail):
        out.print(table)
    for line in notes:
        out.print(Text(line))
