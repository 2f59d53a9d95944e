"""DeepSpeed in ``zbench tune``'s search, estimated: it cannot be traced on fake tensors (it moves and partitions
the model itself), so each DeepSpeed setup is read off the trace of its stand-in, the reference engine at the same
stage, offload mode, micro-batch and checkpointing (``zero1``-``zero3``, which shard and communicate as ZeRO says),
with DeepSpeed's own declared layout (``deepspeed_layout.py``, held within 0.03% of measured) in place of the
stand-in's traced model states. DeepSpeed's options (``TUNABLES``) map onto the stand-in's:

- buckets: at stages 1-2 the stand-in's flat groups hold as many bytes as DeepSpeed's bucket (``bucket_size``
  elements of fp32, the dtype DeepSpeed reduces in here, also under bf16): 50M elements are 190.7 MiB where the
  reference engine's default is 4 MiB. So DeepSpeed's bucket is searched as the reference engine's would be: fewer,
  larger collectives, a larger buffer at the peak;
- ``overlap_comm`` (stages 1-2): off, DeepSpeed's default there, backward's reductions are charged as exposed (the
  step model's serialized phase, ``Tunable.serialized_at``); on, they hide as the stand-in's do, and a second bucket
  buffer is added to the GPU need;
- ``prefetch_size`` (stage 3, elements): the stand-in's prefetch of as many blocks as the elements fill, at least
  one (DeepSpeed gathers part of a block ahead where the reference engine gathers whole blocks: the peak is an upper
  bound), none for 0;
- GPU need: the stand-in's traced peak less its traced model states on the GPU, plus DeepSpeed's, plus the bucket
  buffers DeepSpeed holds where the stand-in holds none (``bucket_buffer_bytes``: stage 3's gradient bucket,
  stages 1-2's second bucket under ``overlap_comm``);
- host need: DeepSpeed's host-held states (its CPU offload) for every rank of a node;
- step time: the stand-in's trace charged with DeepSpeed's serialized phases, plus what DeepSpeed's step costs over
  the stand-in's where the profile's calibration timed both (``zbench calibrate`` probes DeepSpeed where it is
  installed): the difference of their measured probe steps, its operators and host work together, fitted per step,
  per block and per parameter element of a rank's shard (``measured_step_difference``). The operators count:
  DeepSpeed's copies into and out of its buckets are not in the stand-in's trace, and they grow with the bytes (on
  2 CPU cores, 2026-11-29, its stage-1 step was 3 ms over the reference engine's on a 35k-element probe and 35-115
  ms on a 6.5M-element one; without this tune predicted it 7-13% too fast). Not modelled on NCCL: DeepSpeed
  all-reduces each gradient bucket at stages 1-2 where the stand-in reduce-scatters it
  (``DeepSpeed.expected_comm_elements``); on a gloo profile the stand-in's reduce-scatter is charged as the
  all-reduce it issues there (``as_issued``), as DeepSpeed's would be.

Every such setup is labelled "estimated from" its stand-in wherever it is shown.
"""

from __future__ import annotations

from collections.abc import Callable

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.model_source import model_info
from zbench.implementations.deepspeed_zero import BUCKET_ELEMENTS, PREFETCH_ELEMENTS
from zbench.plan.calibrate.overheads import step_difference
from zbench.plan.simulate.calibration import overhead_key
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.compute import implementation_seconds
from zbench.plan.simulate.sweep import serialized
from zbench.plan.trace.plan import taken_options
from zbench.run.aggregate import declared_layout
from zbench.suite.preflight import DEEPSPEED
from zbench.tune.search import Candidate, Limits, Needs, placed_bytes, prune, setup_key
from zbench.tune.space import Question

#: Bytes of one gradient element as DeepSpeed reduces it in zbench's config (fp32: ``communication_data_type``).
COMM_BYTES = 4
#: The stages whose buckets map onto the stand-in's (its ``bucket_mb``), and where ``overlap_comm`` is searched.
BUCKETED_STAGES = frozenset({1, 2})


def stand_in_name(stage: int) -> str:
    """The reference engine at ``stage``: what a DeepSpeed setup at that stage is estimated from."""
    return f"zero{stage}"


def bucket_bytes(case: Case) -> int:
    """Bytes of one of ``case``'s DeepSpeed gradient buckets: its ``bucket_size`` elements in the reduction dtype."""
    return case.options.get("bucket_size", BUCKET_ELEMENTS) * COMM_BYTES


def bucket_mb(case: Case) -> float:
    """The reference engine's bucket (MiB) that holds as many gradients as ``case``'s DeepSpeed bucket."""
    return bucket_bytes(case) / 2**20


def prefetch_blocks(case: Case) -> int:
    """The reference engine's prefetch (blocks ahead) that holds ``case``'s DeepSpeed prefetch (elements ahead): as
    many of the model's largest blocks as it fills, at least one unless it is 0, at most every block."""
    size = case.options.get("prefetch_size", PREFETCH_ELEMENTS)
    blocks = model_info(case.model).block_sizes
    if size == 0 or not blocks:
        return 0 if size == 0 else 1
    return min(len(blocks), -(-size // max(blocks)))


def mapped_option(case: Case) -> tuple[str, float]:
    """The stand-in's option that holds ``case``'s DeepSpeed bucket (stages 1-2) or prefetch (stage 3), and its
    value."""
    return ("bucket_mb", bucket_mb(case)) if case.stage in BUCKETED_STAGES else ("prefetch", prefetch_blocks(case))


def bucket_buffer_bytes(case: Case) -> int:
    """The bucket buffers DeepSpeed holds on the GPU beyond what its stand-in's trace has in their place
    (``DeepSpeedEngine.buffer_bytes`` reads them off a real engine):

    - at stages 1-2 the stand-in's flat groups hold one bucket's bytes, as DeepSpeed's first buffer does; with
      ``overlap_comm`` on DeepSpeed adds a second (``setup_buckets``);
    - at stage 3 DeepSpeed allocates its gradient bucket whole when it builds (``contiguous_gradients``, on by
      default), ``reduce_bucket_size`` elements in the communication dtype, where the stand-in reduces block by
      block into no standing buffer: 190.7 MiB at the 50M-element default.
    """
    bucket = bucket_bytes(case)
    if case.stage not in BUCKETED_STAGES:
        return bucket
    return bucket if case.options.get("overlap_comm", False) else 0


def left_out(q: Question) -> list[str]:
    """What the user is told about DeepSpeed in the search: how it is estimated, or why it cannot be."""
    if DEEPSPEED not in q.implementations or q.precision not in registry.resolve(DEEPSPEED).capabilities.precisions:
        return []  # (the search space says why, as for any implementation)
    stages = sorted(registry.resolve(DEEPSPEED).capabilities.stages)
    missing = [stand_in_name(s) for s in stages if stand_in_name(s) not in q.implementations]
    if len(missing) == len(stages):
        return [f"{DEEPSPEED}: not searched: it is estimated from the traces of {', '.join(missing)}, which were "
                f"left out (-i {' -i '.join(missing)})"]  # fmt: skip
    line = (f"{DEEPSPEED}: estimated, not traced (fake tensors cannot run it yet): each setup is the same stage's "
            "zero1-3 trace, at stages 1-2 with flat groups of DeepSpeed's bucket bytes (backward's reductions "
            "exposed unless overlap_comm), at stage 3 with the blocks its prefetch_size fills, with DeepSpeed's "
            "declared layout in place of its model states")  # fmt: skip
    if missing:
        line += f"; not at the stages of {', '.join(missing)}, left out (-i {' -i '.join(missing)})"
    if absent := registry.resolve(DEEPSPEED).capabilities.missing:
        line += f"; it cannot run here ({absent})"
    return [line]


def first_cases(q: Question, cases: list[Case]) -> list[Case]:
    """A DeepSpeed setup beside each of the search's first ``cases`` that is a stand-in (at the question's options)
    at a stage and offload mode DeepSpeed runs."""
    caps = registry.resolve(DEEPSPEED).capabilities
    if DEEPSPEED not in q.implementations or q.precision not in caps.precisions:
        return []
    out = []
    for s in cases:
        if s.implementation != stand_in_name(s.stage) or s.stage not in caps.stages or s.offload not in caps.offload:
            continue
        if s.options != taken_options(s.implementation, q.options):  # a variant of the stand-in's own options
            continue
        out.append(
            q.case(
                DEEPSPEED, s.stage, s.offload, micro_batch=s.micro_batch, grad_accum=s.grad_accum,
                checkpointing=s.activation_checkpointing, options=taken_options(DEEPSPEED, q.options),
            )
        )  # fmt: skip
    return out


def stand_in(q: Question, case: Case) -> Case:
    """The reference engine's setup a DeepSpeed ``case`` is read off: the same axes and the question's options
    (not DeepSpeed's), at stages 1-2 with ``bucket_mb`` holding DeepSpeed's bucket, at stage 3 with the ``prefetch``
    its ``prefetch_size`` fills."""
    name = stand_in_name(case.stage)
    options = taken_options(name, q.options)
    option, value = mapped_option(case)
    if value == next(t.values[0] for t in registry.resolve(name).capabilities.tunables if t.option == option):
        options.pop(option, None)  # the stand-in's default: the same setup (and trace) as the engine's own
    else:
        options[option] = value
    return q.case(
        name, case.stage, case.offload, micro_batch=case.micro_batch, grad_accum=case.grad_accum,
        checkpointing=case.activation_checkpointing, options=options,
    )  # fmt: skip


def estimate(
    cases: list[Case],
    stand_ins: list[Case],
    run: Callable[[list[Case]], list[Candidate]],
    cluster: Cluster,
    limits: Limits,
) -> list[Candidate]:
    """Each DeepSpeed setup of ``cases`` from its stand-in (``stand_in``, one per case), which ``run`` traces (or
    finds already traced) and judges: DeepSpeed's needs from its layout, pruned as any setup, predicted as its
    stand-in."""
    found = {setup_key(c.case): c for c in run(stand_ins)} if stand_ins else {}
    return [_estimated(case, found[setup_key(s)], cluster, limits) for case, s in zip(cases, stand_ins, strict=True)]


def _estimated(case: Case, c: Candidate, cluster: Cluster, limits: Limits) -> Candidate:
    ds = Candidate(case)
    option, value = mapped_option(case)
    ds.estimated_from = f"{c.case.implementation}, {option} {value:g}"
    if c.traced is None or c.needs is None:
        traced = "could not be traced" if c.traced is not None else "was not traced"
        ds.pruned = f"estimated from {c.name}, which {traced}: {c.pruned}"
        ds.overshoot = c.overshoot
        return ds
    place, _ = declared_layout(case)
    ds.traced = c.traced
    ds.needs = Needs(
        gpu=c.needs.gpu - c.traced.row.located("device") + placed_bytes(place, "device") + bucket_buffer_bytes(case),
        host_per_node=placed_bytes(place, "host") * limits.gpus_per_node,
        disk_per_node=placed_bytes(place, "disk") * limits.gpus_per_node,
    )
    prune(ds, limits, by=f" (estimated: {c.case.implementation}'s trace with DeepSpeed's layout)")
    if ds.pruned is None:
        stand_in_step = c.traced.estimate(cluster, serialized_phases=serialized(case, cluster))
        ds.estimate = stand_in_step.with_host_work(measured_step_difference(cluster, c.case, case))
    return ds


def measured_step_difference(cluster: Cluster, stand_in: Case, case: Case) -> float:
    """Seconds per step DeepSpeed costs over the stand-in (``zbench.plan.calibrate.overheads``): where the profile
    timed both on every probe, their measured steps' difference at each probe fitted as ``per_step + per_block x
    blocks + per_element x elements`` through the probes and taken at ``case``'s model; in a profile that kept no
    probe steps (before schema 4), the difference of their fitted host work alone; 0 where the profile did not
    measure both (a datasheet profile, a calibration without DeepSpeed).

    The element term is charged on a rank's shard (Ψ / N): the probes run at world 1, where shard and model are one,
    and the wide probe at world 2 (gloo, 2 CPU cores, 2026-11-29, a script not in the project) measured DeepSpeed
    46 ms over zero1 at stage 1 and 27 ms over zero2 at stage 2 where world 1 measured 82 and 35 ms: most of the
    work is on the rank's fp32 partition (all of it would halve the difference, none would keep it)."""
    rates = cluster.operator_rates()
    keys = (overhead_key(DEEPSPEED, case.stage), overhead_key(stand_in.implementation, stand_in.stage))
    if rates is None or not all(k in rates.overheads for k in keys):
        return 0.0
    info = model_info(case.model)
    blocks, elements = len(info.block_sizes), info.parameters
    deepspeed, reference = (rates.overheads[k] for k in keys)
    if (fit := step_difference(deepspeed, reference)) is not None:
        per_step, per_block, per_element = fit
        return per_step + per_block * blocks + per_element * elements / case.world_size
    return implementation_seconds(rates, DEEPSPEED, case.stage, blocks) - implementation_seconds(
        rates, stand_in.implementation, stand_in.stage, blocks
    )
