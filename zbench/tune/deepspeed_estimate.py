"""DeepSpeed in ``zbench tune``'s search, estimated: it cannot be traced on fake tensors (it moves and partitions
the model itself), so each DeepSpeed setup is read off the trace of the reference engine at the same stage,
offload mode, micro-batch and checkpointing (``zero1``-``zero3``, which shard and communicate as ZeRO says), with
DeepSpeed's own declared layout (``deepspeed_layout.py``, held within 0.03% of measured) in place of the stand-in's
traced model states:

- GPU need: the stand-in's traced peak less its traced model states on the GPU, plus DeepSpeed's;
- host need: DeepSpeed's host-held states (its CPU offload) for every rank of a node;
- step time: the stand-in's prediction, with DeepSpeed's own host work in place of the stand-in's where the
  profile's calibration measured both (``zbench calibrate`` probes DeepSpeed where it is installed: on 2 CPU
  cores its host work was 1.6-2.8x the reference engine's at stages 1-2 and about 6x at stage 3); DeepSpeed's
  own bucketing and overlap are not modelled.

Every such setup is labelled "estimated" wherever it is shown.
"""

from __future__ import annotations

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.model_source import model_info
from zbench.plan.simulate.calibration import overhead_key
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.compute import implementation_seconds
from zbench.plan.trace.plan import make_case
from zbench.run.aggregate import declared_layout
from zbench.suite.preflight import DEEPSPEED
from zbench.tune.search import Candidate, Limits, Needs, placed_bytes, prune
from zbench.tune.space import Question, grad_accum_for


def stand_in_name(stage: int) -> str:
    """The reference engine at ``stage``: what a DeepSpeed setup at that stage is estimated from."""
    return f"zero{stage}"


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
            "zero1-3 trace with DeepSpeed's declared layout in place of its model states")  # fmt: skip
    if missing:
        line += f"; not at the stages of {', '.join(missing)}, left out (-i {' -i '.join(missing)})"
    if absent := registry.resolve(DEEPSPEED).capabilities.missing:
        line += f"; it cannot run here ({absent})"
    return [line]


def estimate(q: Question, searched: list[Candidate], cluster: Cluster, limits: Limits) -> list[Candidate]:
    """A DeepSpeed candidate for each traced stand-in whose stage and offload mode DeepSpeed runs, its needs from
    DeepSpeed's layout, pruned as any setup, predicted as its stand-in."""
    caps = registry.resolve(DEEPSPEED).capabilities
    if DEEPSPEED not in q.implementations or q.precision not in caps.precisions:
        return []
    out = []
    for c in searched:
        s = c.case
        if s.implementation != stand_in_name(s.stage) or s.stage not in caps.stages or s.offload not in caps.offload:
            continue
        if s.options != q.options:  # a variant of the stand-in's own options (zbench.tune.options), not DeepSpeed's
            continue
        case = make_case(
            q.model, DEEPSPEED, s.stage, s.offload, gpus=q.gpus, precision=q.precision, micro_batch=s.micro_batch,
            seq_len=q.seq_len, device=q.device, checkpointing=s.activation_checkpointing,
        )  # fmt: skip
        accum = grad_accum_for(q, s.micro_batch) or 1
        ds = Candidate(case.model_copy(update={"grad_accum": accum}) if accum > 1 else case)
        ds.estimated_from = s.implementation
        out.append(ds)
        if c.traced is None or c.needs is None:
            traced = "could not be traced" if c.traced is not None else "was not traced"
            ds.pruned = f"estimated from {c.name}, which {traced}: {c.pruned}"
            ds.overshoot = c.overshoot
            continue
        place, _ = declared_layout(ds.case)
        ds.traced = c.traced
        ds.needs = Needs(
            gpu=c.needs.gpu - c.traced.row.located("device") + placed_bytes(place, "device"),
            host_per_node=placed_bytes(place, "host") * limits.gpus_per_node,
            disk_per_node=placed_bytes(place, "disk") * limits.gpus_per_node,
        )
        prune(ds, limits, by=f" (estimated: {s.implementation}'s trace with DeepSpeed's layout)")
        if ds.pruned is None:
            stand_in = c.estimate if c.estimate is not None else c.traced.estimate(cluster)
            ds.estimate = stand_in.with_host_work(host_work_difference(cluster, s, ds.case))
    return out


def host_work_difference(cluster: Cluster, stand_in: Case, case: Case) -> float:
    """Seconds per step DeepSpeed's calibrated host work exceeds the stand-in's (``zbench.plan.calibrate.overheads``),
    or 0 where the profile did not measure both (a datasheet profile, a calibration without DeepSpeed)."""
    rates = cluster.operator_rates()
    keys = (overhead_key(DEEPSPEED, case.stage), overhead_key(stand_in.implementation, stand_in.stage))
    if rates is None or not all(k in rates.overheads for k in keys):
        return 0.0
    blocks = len(model_info(case.model).block_sizes)
    return implementation_seconds(rates, DEEPSPEED, case.stage, blocks) - implementation_seconds(
        rates, stand_in.implementation, stand_in.stage, blocks
    )
