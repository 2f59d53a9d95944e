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
from zbench.plan.memory import usable_bytes
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.step import StepEstimate
from zbench.plan.simulate.sweep import estimate_row
from zbench.plan.trace.plan import TracedRow
from zbench.results.formatting import fmt_bytes
from zbench.tune.cache import TraceCache, trace_key
from zbench.tune.extrapolate import DEPTHS, Extrapolated, can_extrapolate, cuts
from zbench.tune.space import describe
from zbench.tune.tracers import Tracers

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
        return usable_bytes(self.gpu_bytes, self.reserve)


@dataclass(frozen=True)
class Needs:
    """What a traced setup needs: its GPU peak per rank, and its host and disk state per node."""

    gpu: float
    host_per_node: float
    disk_per_node: float


@dataclass
class Candidate:
    """One setup: its trace (none when pruned before tracing), its needs, why it was pruned, or its predicted
    step."""

    case: Case
    traced: Traced | None = None
    needs: Needs | None = None
    pruned: str | None = None
    overshoot: float = 0.0
    """Bytes over the tightest limit it broke, as a share of that limit."""
    estimate: StepEstimate | None = None
    estimated_from: str | None = None
    """The traced setup this one's needs and step are read off, where it cannot be traced itself (DeepSpeed:
    ``zbench.tune.deepspeed_estimate``)."""

    @property
    def name(self) -> str:
        return describe(self.case) + (f" (estimated from {self.estimated_from})" if self.estimated_from else "")

    @property
    def cached(self) -> bool:
        return self.traced is not None and self.traced.cached

    @property
    def extrapolated(self) -> bool:
        """Traced as two cuts of the model and extrapolated over blocks."""
        return self.traced is not None and self.traced.extrapolated is not None


def needs_of(row: TracedRow, gpus_per_node: int) -> Needs:
    """A traced setup's needs: its device peak less the host-held bytes the CPU stand-in counts in it, as
    ``zbench plan --trace`` shows it (``TracedRow.host_held_in_peak``); on the host, its host-held state and
    buffers (``TracedRow.host_held``)."""
    return Needs(
        gpu=max(row.peak("device") - row.host_held_in_peak(), 0.0),
        host_per_node=row.host_held() * gpus_per_node,
        disk_per_node=row.located("disk") * gpus_per_node,
    )


def prune(candidate: Candidate, limits: Limits, *, needs: Needs | None = None, by: str = "") -> None:
    """Mark ``candidate`` pruned by the first limit its needs (``needs``, else its own) break, with the need, the
    limit and the overshoot; ``by`` says where ``needs`` come from when not from its own trace."""
    n = needs or candidate.needs
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
            candidate.pruned = f"{what}: needs {fmt_bytes(need)}{by}, has {fmt_bytes(have)}{note}: {over}"
            return


@dataclass
class Traced:
    """One setup's trace: whole, or the line through two cuts of its model (``extrapolated``)."""

    row: TracedRow
    cached: bool
    extrapolated: Extrapolated | None = None

    def estimate(self, cluster: Cluster, *, serialized_phases: frozenset[str] | None = None) -> StepEstimate:
        """The traced setup's step; ``serialized_phases`` charges those phases' collectives as exposed in place of
        its own options' (a DeepSpeed setup read off this trace: ``zbench.tune.deepspeed_estimate``)."""
        world = self.row.case.world_size  # every setup is traced at the user's GPU count
        compute = self.extrapolated.phase_compute(cluster, world) if self.extrapolated else None
        return estimate_row(self.row, cluster, world, compute, serialized_phases=serialized_phases)


def trace_all(
    cases: list[Case],
    *,
    cache: TraceCache | None,
    tracers: Tracers,
    progress: Callable[[str], None],
    extrapolate: bool = True,
    fresh: bool = False,
) -> list[Traced]:
    """Each case traced (or taken from the cache, unless ``fresh``; every new trace is stored), in the cases'
    order; with ``extrapolate``, a deep model's setups from two shallow cuts (``zbench.tune.extrapolate``)."""
    plans = {id(c): (cuts(c) if extrapolate and can_extrapolate(c) else (c,)) for c in cases}
    jobs = list({trace_key(job): job for c in cases for job in plans[id(c)]}.values())
    found: dict[str, TracedRow] = {}
    for job in jobs:
        trace = cache.get(job) if cache and not fresh else None
        if trace is not None:
            found[trace_key(job)] = TracedRow(job, trace, placement_for(job))
    missing = [job for job in jobs if trace_key(job) not in found]
    depths = " and ".join(map(str, DEPTHS))
    cut = f" (cut to {depths} blocks, extrapolated over blocks)" if any(len(p) == 2 for p in plans.values()) else ""
    progress(f"{len(cases)} setups: {len(jobs)} traces{cut}, {len(found)} from the cache, {len(missing)} to run")
    if missing:

        def keep(job: Case, row: TracedRow) -> None:
            found[trace_key(job)] = row
            if cache:
                cache.put(job, row.trace)

        tracers.trace(missing, progress=progress, done=keep)
    traced_now = {trace_key(job) for job in missing}
    out = []
    for c in cases:
        keys = [trace_key(job) for job in plans[id(c)]]
        cached = not any(k in traced_now for k in keys)
        if len(keys) == 1:
            out.append(Traced(found[keys[0]], cached))
        else:
            line = Extrapolated(c, found[keys[0]], found[keys[1]])
            out.append(Traced(line.row(), cached, line))
    return out


#: The share by which a rank's traced model states may fall short of the ZeRO formula's (the formula's fullest
#: rank; a layout dealing whole tensors may give rank 0 a little less): a setup is pruned before tracing only
#: when the formula's model states alone exceed the GPU by more.
FORMULA_SLACK = 0.05


def formula_needs(case: Case, gpus_per_node: int) -> Needs:
    """The ZeRO formulas' model states for ``case``'s layout less ``FORMULA_SLACK``: a lower bound on what its trace
    would need."""
    place = placement_for(case)

    def at(where: str) -> float:
        return placed_bytes(place, where) * (1 - FORMULA_SLACK)

    return Needs(gpu=at("device"), host_per_node=at("host") * gpus_per_node, disk_per_node=at("disk") * gpus_per_node)


def placed_bytes(place: dict[str, dict[str, float]], where: str) -> float:
    """A placement's bytes in one location, over every category."""
    return sum(cat.get(where, 0.0) for cat in place.values())


def search(
    cases: list[Case],
    cluster: Cluster,
    limits: Limits,
    *,
    cache: TraceCache | None,
    tracers: Tracers,
    progress: Callable[[str], None],
    extrapolate: bool = True,
    fresh: bool = False,
) -> list[Candidate]:
    """Every setup, pruned and ranked: the survivors first by predicted tokens/s per GPU (fastest first), then the
    pruned by overshoot (nearest to fitting first).

    Tracing is spent only where it can change the answer. A setup whose model states alone, by the formulas,
    overflow the GPU or a node's host or disk is pruned untraced. The rest are traced a micro-batch at a time,
    smallest first: a setup that does not fit the GPU at one micro-batch will not at a larger one (activations
    only grow), so its larger micro-batches are pruned untraced, naming the one that did not fit (compared only
    between micro-batches that both accumulate gradients, or both do not: ``_siblings``). An NVMe setup is traced
    only where host memory or disk, not the GPU, ruled out its host twin (``host_twin``).
    """
    candidates = [Candidate(case) for case in cases]
    by = f" at least (model states alone: the ZeRO formulas' less {FORMULA_SLACK:.0%}; not traced)"
    for c in candidates:
        prune(c, limits, needs=formula_needs(c.case, limits.gpus_per_node), by=by)
    untraced = sum(c.pruned is not None for c in candidates)
    if untraced:
        progress(f"{untraced} of {len(candidates)} setups pruned by the formulas' model states alone, untraced")
    too_big: dict[tuple, int] = {}  # a setup's other axes -> the smallest micro-batch that did not fit the GPU
    for mb in sorted({c.case.micro_batch for c in candidates}):
        batch = []
        for c in candidates:
            if c.case.micro_batch != mb or c.pruned is not None:
                continue
            if (smaller := too_big.get(_siblings(c.case))) is not None:
                c.pruned = f"GPU: micro-batch {smaller} of the same setup already does not fit (not traced)"
                c.overshoot = float("inf")
            else:
                batch.append(c)
        if not batch:
            continue
        progress(f"micro-batch {mb}: {len(batch)} setups")

        def trace_and_judge(part: list[Candidate]) -> None:
            if part:
                traced = trace_all(
                    [c.case for c in part], cache=cache, tracers=tracers, progress=progress, extrapolate=extrapolate,
                    fresh=fresh,
                )  # fmt: skip
                for c, t in zip(part, traced, strict=True):
                    _judge(c, t, cluster, limits)

        trace_and_judge([c for c in batch if c.case.offload != "nvme"])
        judged = {setup_key(o.case): o for o in candidates if o.needs is not None}
        trace_and_judge([c for c in batch if c.case.offload == "nvme" and not _host_twin_decides(c, judged)])
        for c in batch:
            if c.pruned and c.pruned.startswith("GPU"):
                too_big.setdefault(_siblings(c.case), mb)
    return ranked(candidates)


def host_twin(case: Case) -> Case:
    """An NVMe setup's twin on the host: the same setup with CPU offload of what the disk tier holds (the optimizer
    state and masters; at stage 3 the parameters too: ``optimizer+params``).

    The twin needs no more of the GPU (the disk tier streams through host buffers: gpt-70b on 64 GPUs, ZeRO-3, took
    14.48 GiB against the twin's 14.47 with 1 MiB sub-groups, 2026-11-29; the CPU stand-in counts those buffers in
    the GPU peak, up to 576 MiB at the 64 MiB default, so there the NVMe setup reads more) and its offload moves
    the same bytes at host-memory speed instead of the disk's: wherever the twin fits, the NVMe setup is no faster
    and no leaner on the GPU. ZeRO-Infinity is for where host memory cannot hold the twin's states."""
    return case.model_copy(update={"offload": "optimizer+params" if case.stage == 3 else "optimizer"})


def _host_twin_decides(c: Candidate, judged: dict[tuple, Candidate]) -> bool:
    """Whether ``c``, an NVMe setup, is pruned untraced by its host twin (among the ``judged`` setups, by
    ``setup_key``): the twin fits, or it does not fit the GPU, which ``c`` needs no less of. Where host memory (or
    disk) pruned the twin, ``c`` is traced."""
    twin = judged.get(setup_key(host_twin(c.case)))
    if twin is None or (twin.pruned is not None and not twin.pruned.startswith("GPU")):
        return False
    if twin.pruned is None:
        c.pruned = f"not traced: its host twin ({twin.name}) fits, needs no more GPU and offloads faster"
    else:
        c.pruned = f"GPU: its host twin ({twin.name}) already does not fit, and it needs no less (not traced)"
    c.overshoot = float("inf")
    return True


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """The survivors by predicted tokens/s per GPU (fastest first), then the pruned by overshoot (nearest first)."""
    survivors = sorted((c for c in candidates if c.pruned is None), key=lambda c: -_rate(c))
    pruned = sorted((c for c in candidates if c.pruned is not None), key=lambda c: c.overshoot)
    return survivors + pruned


def _siblings(case: Case) -> tuple:
    """What a setup is apart from its micro-batch, and whether it accumulates gradients: a setup that accumulates
    (FSDP keeps whole gradients between micro-steps) may need more than a larger micro-batch that does not, so
    the two are not compared; nor are two setups whose options differ (a ZeRO-3 prefetch of 2 holds more than a
    prefetch of 0 at a larger micro-batch)."""
    return (case.implementation, case.stage, case.offload, case.activation_checkpointing, case.grad_accum > 1,
            options_key(case))  # fmt: skip


def options_key(case: Case) -> str:
    """``case``'s options as a hashable key, whatever their order (a case id does not name them)."""
    return repr(sorted(case.options.items()))


def setup_key(case: Case) -> tuple:
    """What tells two searched setups apart (a case id names neither the batch nor the options)."""
    return (case.case_id, case.micro_batch, case.grad_accum, case.activation_checkpointing,
            options_key(case))  # fmt: skip


def _judge(c: Candidate, t: Traced, cluster: Cluster, limits: Limits) -> None:
    """Read ``c``'s needs off its trace, prune it or predict its step."""
    c.traced = t
    if t.row.trace.error:
        c.pruned = f"cannot trace: {t.row.trace.error}"
        c.overshoot = float("inf")
        return
    c.needs = needs_of(t.row, limits.gpus_per_node)
    prune(c, limits)
    if c.pruned is None:
        c.estimate = t.estimate(cluster)


def _rate(c: Candidate) -> float:
    return c.estimate.tokens_per_s_per_gpu if c.estimate else 0.0


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
    ZeRO formulas for its model states (in the layout its implementation declares) plus what its trace holds
    beyond them (activations, gathered parameters, buffers: the same per rank at any count; nothing when it was
    not traced), or None up to ``most``. An estimate, labelled so where shown; disk is not checked."""
    case = c.case
    beyond_states = host_beyond = 0.0  # untraced: the model states alone
    if c.needs is not None and c.traced is not None:
        beyond_states = c.needs.gpu - c.traced.row.located("device")
        host_beyond = c.needs.host_per_node / limits.gpus_per_node - c.traced.row.located("host")
    gpus = case.world_size * 2
    while gpus <= most:
        place = placement_for(case.model_copy(update={"world_size": gpus}))  # the layout the implementation declares
        device = placed_bytes(place, "device") + beyond_states
        host = (placed_bytes(place, "host") + host_beyond) * limits.gpus_per_node
        if device <= limits.usable_gpu_bytes and (
            limits.host_bytes_per_node is None or host <= limits.host_bytes_per_node
        ):
            return gpus
        gpus *= 2
    return None
