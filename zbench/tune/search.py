"""Trace every setup of the search space (or take its trace from the cache), prune what does not fit, and rank
the rest by predicted tokens/s per GPU.

Memory is the implementations' own, traced on fake tensors: a setup's GPU need is its traced peak of live bytes
(activations, gathered parameters, buffers: everything the step holds at once), which must fit in the GPU's
memory less ``reserve`` (the allocator's fragmentation and the CUDA context, which a trace does not see; the
same share ``zbench plan`` keeps). Host and disk needs are the traced offloaded state of every rank of a node.
The ranking is the step-time simulator's (``zbench.plan.simulate``) on the user's cluster profile, with the
measured error its compute model has against real runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zbench.cases.case import Case
from zbench.cases.formulas import placement_for
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.step import StepEstimate
from zbench.plan.simulate.sweep import simulate
from zbench.plan.trace.plan import TracedRow, trace_plan
from zbench.results.formatting import fmt_bytes
from zbench.tune.cache import TraceCache
from zbench.tune.space import describe

GIB = 2**30


@dataclass(frozen=True)
class Limits:
    """What one GPU and one node offer; ``None``: not checked."""

    gpu_bytes: float
    reserve: float
    host_bytes_per_node: float | None
    disk_bytes_per_node: float | None
    gpus_per_node: int

    @property
    def usable_gpu_bytes(self) -> float:
        return self.gpu_bytes * (1 - self.reserve)


@dataclass(frozen=True)
class Needs:
    """What a traced setup needs: its GPU peak per rank, and its host and disk state per node."""

    gpu: float
    host_per_node: float
    disk_per_node: float


@dataclass
class Candidate:
    """One setup: its trace, its needs, why it was pruned (or its predicted step)."""

    row: TracedRow
    needs: Needs | None
    cached: bool
    pruned: str | None = None
    overshoot: float = 0.0
    """Bytes over the tightest limit it broke, as a share of that limit."""
    estimate: StepEstimate | None = None

    @property
    def case(self) -> Case:
        return self.row.case

    @property
    def name(self) -> str:
        return describe(self.case)


def needs_of(row: TracedRow, gpus_per_node: int) -> Needs:
    """A traced setup's needs. On the CPU stand-in (fake CPU tensors) the host-held state shares the traced
    device's peak, and is taken off it, as ``zbench plan --trace`` does."""
    host = row.located("host")
    device_peak = row.peak("device") - (host if row.case.device == "cpu" else 0.0)
    return Needs(
        gpu=max(device_peak, 0.0), host_per_node=host * gpus_per_node, disk_per_node=row.located("disk") * gpus_per_node
    )


def prune(candidate: Candidate, limits: Limits) -> None:
    """Mark ``candidate`` pruned by the first limit it breaks, with the need, the limit and the overshoot."""
    n = candidate.needs
    if n is None:
        return
    checks = [
        ("GPU", n.gpu, limits.usable_gpu_bytes, f" ({limits.reserve:.0%} of {fmt_bytes(limits.gpu_bytes)} kept free)"),
        ("host per node", n.host_per_node, limits.host_bytes_per_node, ""),
        ("disk per node", n.disk_per_node, limits.disk_bytes_per_node, ""),
    ]
    for what, need, have, note in checks:
        if have is not None and need > have:
            candidate.overshoot = (need - have) / have if have else float("inf")
            over = f"over by {candidate.overshoot:.0%}"
            candidate.pruned = f"{what}: needs {fmt_bytes(need)}, has {fmt_bytes(have)}{note}: {over}"
            return


def trace_all(
    cases: list[Case], *, cache: TraceCache | None, progress: Callable[[str], None]
) -> list[tuple[TracedRow, bool]]:
    """Each case's traced row and whether it came from the cache, in the cases' order."""
    found: dict[int, TracedRow] = {}
    for i, case in enumerate(cases):
        trace = cache.get(case) if cache else None
        if trace is not None:
            found[i] = TracedRow(case, trace, placement_for(case))
    missing = [i for i in range(len(cases)) if i not in found]
    if found:
        progress(f"{len(found)} of {len(cases)} setups traced before (cache); tracing {len(missing)}")
    if missing:
        device = cases[missing[0]].device
        traced = trace_plan([cases[i] for i in missing], device=device, progress=progress)
        for i, row in zip(missing, traced, strict=True):
            if cache:
                cache.put(cases[i], row.trace)
            found[i] = row
    return [(found[i], i not in missing) for i in range(len(cases))]


def rank(rows: list[tuple[TracedRow, bool]], cluster: Cluster, limits: Limits) -> list[Candidate]:
    """Every setup, the survivors first by predicted tokens/s per GPU (fastest first), then the pruned by overshoot
    (nearest to fitting first), then those that could not be traced."""
    candidates = []
    for row, cached in rows:
        c = Candidate(row, None if row.trace.error else needs_of(row, limits.gpus_per_node), cached)
        if row.trace.error:
            c.pruned = f"cannot trace: {row.trace.error}"
            c.overshoot = float("inf")
        prune(c, limits)
        candidates.append(c)
    survivors = [c for c in candidates if c.pruned is None]
    if survivors:
        world = survivors[0].case.world_size  # every setup is traced at the user's GPU count
        for c, sim in zip(survivors, simulate([c.row for c in survivors], cluster, [world]), strict=True):
            c.estimate = sim.estimates[0]
    survivors.sort(key=lambda c: -c.estimate.tokens_per_s_per_gpu if c.estimate else 0.0)
    pruned = sorted((c for c in candidates if c.pruned is not None), key=lambda c: c.overshoot)
    return survivors + pruned


def best_per_implementation(ranked: list[Candidate]) -> list[Candidate]:
    """The fastest surviving setup of each implementation, in ranking order."""
    seen: set[str] = set()
    best = []
    for c in ranked:
        if c.pruned is None and c.case.implementation not in seen:
            seen.add(c.case.implementation)
            best.append(c)
    return best


def what_separates(faster: Candidate, slower: Candidate) -> str:
    """Why ``slower`` is behind ``faster``, in words: the step's parts that differ most."""
    a, b = faster.estimate, slower.estimate
    if a is None or b is None:
        return ""
    per_token = {
        "compute": b.compute_s / _tokens(slower) - a.compute_s / _tokens(faster),
        "exposed communication": b.exposed_comm_s / _tokens(slower) - a.exposed_comm_s / _tokens(faster),
        "offload": b.offload_s / _tokens(slower) - a.offload_s / _tokens(faster),
    }
    part = max(per_token, key=lambda k: per_token[k])
    behind = 1 - b.tokens_per_s_per_gpu / a.tokens_per_s_per_gpu if a.tokens_per_s_per_gpu else 0.0
    return f"{behind:.1%} slower, mostly {part}" if per_token[part] > 0 else f"{behind:.1%} slower"


def _tokens(c: Candidate) -> int:
    return c.case.micro_batch * c.case.grad_accum * c.case.seq_len


def gpus_that_would_fit(c: Candidate, limits: Limits, *, most: int = 65536) -> int | None:
    """The fewest GPUs (the asked count doubled, and doubled again) at which ``c`` would fit GPU and host, by the
    ZeRO formulas for its model states plus what its trace holds beyond them (activations, gathered parameters,
    buffers: the same per rank at any count), or None up to ``most``. An estimate, labelled so where shown."""
    from zbench.cases.formulas import placement
    from zbench.cases.model_source import model_info

    if c.needs is None:
        return None
    case = c.case
    params = model_info(case.model).parameters
    beyond_states = c.needs.gpu - c.row.located("device")
    host_beyond = c.needs.host_per_node / limits.gpus_per_node - c.row.located("host")
    gpus = case.world_size * 2
    while gpus <= most:
        place = placement(params=params, world=gpus, stage=case.stage, precision=case.precision, offload=case.offload)
        device = sum(cat["device"] for cat in place.values()) + beyond_states
        host = (sum(cat["host"] for cat in place.values()) + host_beyond) * limits.gpus_per_node
        if device <= limits.usable_gpu_bytes and (
            limits.host_bytes_per_node is None or host <= limits.host_bytes_per_node
        ):
            return gpus
        gpus *= 2
    return None
