"""Step time of one traced case on a cluster: compute, an alpha-beta model of each traced collective, overlap, offload.

The trace (``zbench.plan.trace.tracer``) says which collectives one rank issues per step, with their logical
bytes (the ledger's counting: an all-gather its output, a reduce-scatter its input, an all-reduce twice its
buffer) and the phase that issues them. Per rank these volumes do not depend on the world size (ZeRO's 2Ψ
and 3Ψ), so one trace serves every world size of a sweep. The model (docs/methods.md#simulation):

- compute: the model's training FLOPs per step over ``peak x efficiency``; a third is forward, two thirds
  backward, plus one more forward with activation checkpointing. With a calibrated profile and a trace
  that recorded its operators, each phase's compute is instead the sum of its operators' measured costs
  (``zbench.plan.simulate.compute``), the optimizer step's included;
- a collective over ``p`` ranks at bus bandwidth ``B`` (the node's link when ``p`` fits in a node, else the
  slower of node and network): ring all-gather / reduce-scatter ``L_ring + (p-1)/p S / B``; all-reduce the
  faster of ring ``2 L_ring + (p-1)/p S / B`` and tree ``2 L_tree + S / B`` (``S``: the ledger's bytes,
  already twice the buffer); broadcast ``L_tree + S / B``. ``L_ring`` is one hop per rank, at the node's
  latency except one network hop per node; ``L_tree`` is log2 levels in the node plus log2 across nodes.
  Every call pays its latency;
- overlap: what forward issues hides behind forward compute, what backward issues behind backward compute
  (scaled by the cluster's ``overlap``), except one call each (the first gather, the last bucket, which
  nothing can hide); what comes after backward (ZeRO-1/2's parameter all-gather, the norm) is exposed;
- offload: the PCIe and NVMe bytes the offload placement moves per step (from the ZeRO-Offload formulas,
  not traced) and the host optimizer step, exposed (no overlap assumed); on a CPU with operator compute, the
  host's work is the traced operators' and only NVMe's I/O is added.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from typing import Any

from zbench.plan.simulate.cluster import Cluster

PHASES = ("forward", "backward", "after_backward")


def crossing_bytes(op: str, nbytes: float, ranks: int) -> float:
    """The share of the ledger's bytes that crosses the slowest link: ``(ranks-1)/ranks`` of them for ring
    collectives, all of them for a broadcast."""
    return nbytes if op == "broadcast" else nbytes * (ranks - 1) / ranks


def collective_seconds(op: str, nbytes: float, count: int, world: int, cluster: Cluster) -> float:
    """Time of ``count`` calls of ``op`` moving ``nbytes`` (the ledger's logical bytes) in all over ``world`` ranks.

    Where the profile's calibration measured ``op`` over exactly ``world`` ranks, its fitted curve (each call its
    latency, the bytes at its bandwidth): on a CPU, four ranks sharing two cores pay what a link model of two
    cannot say. Otherwise the link model: ring and tree latencies from the per-hop figures, the slowest link's
    bandwidth."""
    if world <= 1 or count == 0:
        return 0.0
    if (curve := cluster.curve(op, world)) is not None:
        return count * curve.latency_us * 1e-6 + crossing_bytes(op, nbytes, world) / (curve.bandwidth_gb_s * 1e9)
    beta = 1 / cluster.bandwidth(world)
    share = (world - 1) / world
    if op == "all_reduce":  # NCCL picks the faster of ring and tree
        ring = count * 2 * cluster.ring_latency(world) + share * nbytes * beta
        tree = count * 2 * cluster.tree_latency(world) + nbytes * beta
        return min(ring, tree)
    if op == "broadcast":
        return count * cluster.tree_latency(world) + nbytes * beta
    return count * cluster.ring_latency(world) + share * nbytes * beta  # all_gather, reduce_scatter


@dataclass(frozen=True)
class StepEstimate:
    world: int
    compute_s: float
    comm_s: float
    """Every collective's time, hidden or not."""
    exposed_comm_s: float
    offload_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    comm_to_compute: float
    compute_model: str
    """``operators`` (each traced operator at its calibrated cost) or ``peak x efficiency``."""
    hides_gathers: bool
    """Forward and backward hide all their collectives but the one call each that nothing can hide."""
    phase_comm_s: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def with_host_work(self, seconds: float) -> StepEstimate:
        """The same step with ``seconds`` more host work after backward (negative: less), exposed as all host
        work is: another implementation's calibrated overhead in place of this one's."""
        step = max(self.step_s + seconds, 1e-12)
        compute = max(self.compute_s + seconds, 1e-12)
        return replace(
            self,
            compute_s=compute,
            step_s=step,
            tokens_per_s_per_gpu=self.tokens_per_s_per_gpu * self.step_s / step,
            mfu=self.mfu * self.step_s / step,
            comm_to_compute=self.comm_s / compute,
        )


def offload_seconds(
    *, params: int, world: int, stage: int, offload: str, cluster: Cluster, host_work_traced: bool = False
) -> float:
    """PCIe copies, NVMe reads and writes and the host optimizer step per step, from the offload placement.

    ``host_work_traced``: the traced operators already charge the host's optimizer step and its copies (on a CPU,
    where the host is the device: ``zbench.plan.simulate.compute.phase_seconds``), so only NVMe's I/O is left."""
    if offload == "none":
        return 0.0
    shard = params / world
    pcie = 8 * shard  # fp32 gradient partition to the host, fp32 master partition back
    nvme = 0.0
    if offload == "optimizer+params" and stage == 3:
        pcie += 2 * 2 * shard  # the bf16 parameter shard uploaded for each gather, forward and backward
    if offload == "nvme":
        nvme = 2 * 12 * shard  # optimizer state (8) and fp32 master (4) read and written back
        if stage == 3:
            nvme += 2 * 2 * shard  # parameter shard read for each gather
    nvme_per_gpu = cluster.nvme_gb_s_per_node * 1e9 / min(world, cluster.gpus_per_node)
    if host_work_traced:
        return nvme / nvme_per_gpu
    return pcie / (cluster.pcie_gb_s * 1e9) + nvme / nvme_per_gpu + shard / cluster.host_adam_params_per_s


def _exposed(comm: float, calls: int, compute: float, overlap: float) -> tuple[float, bool]:
    if calls == 0:
        return 0.0, True
    one = comm / calls
    hidden_part = comm - one
    return one + max(0.0, hidden_part - overlap * compute), hidden_part <= overlap * compute


def estimate(
    phases: dict[str, dict[str, dict[str, int]]],
    *,
    cluster: Cluster,
    world: int,
    flops_per_step: float,
    params: int,
    stage: int,
    offload: str,
    checkpointing: bool,
    tokens_per_step: int,
    phase_compute: dict[str, float] | None = None,
    serialized: Collection[str] = (),
) -> StepEstimate:
    """One rank's step at ``world`` ranks; ``flops_per_step`` and ``tokens_per_step`` are one rank's.

    ``phase_compute`` (seconds per phase from the traced operators) replaces the FLOPs-over-peak compute.
    ``serialized``: the phases (``forward``, ``backward``) in which the implementation waits for each collective as
    it issues it (``Tunable.serialized_at``), so that none of theirs is hidden."""
    if phase_compute is not None:
        forward, backward = phase_compute.get("forward", 0.0), phase_compute.get("backward", 0.0)
        after = phase_compute.get("after_backward", 0.0)
    else:
        rate = cluster.peak_tflops * 1e12 * cluster.efficiency
        forward = flops_per_step / 3 / rate
        backward = 2 * flops_per_step / 3 / rate + (forward if checkpointing else 0.0)
        after = 0.0
    compute = forward + backward + after
    per_phase = {
        phase: sum(collective_seconds(op, e["bytes"], e["count"], world, cluster) for op, e in ops.items())
        for phase, ops in phases.items()
    }
    calls = {phase: sum(e["count"] for e in ops.values()) for phase, ops in phases.items()}
    overlap = {phase: 0.0 if phase in serialized else cluster.overlap for phase in ("forward", "backward")}
    exposed_f, hid_f = _exposed(per_phase.get("forward", 0.0), calls.get("forward", 0), forward, overlap["forward"])
    exposed_b, hid_b = _exposed(per_phase.get("backward", 0.0), calls.get("backward", 0), backward, overlap["backward"])
    exposed = exposed_f + exposed_b + per_phase.get("after_backward", 0.0)
    off = offload_seconds(
        params=params, world=world, stage=stage, offload=offload, cluster=cluster,
        host_work_traced=phase_compute is not None and cluster.on_cpu(),
    )  # fmt: skip
    step = compute + exposed + off
    comm = sum(per_phase.values())
    return StepEstimate(
        world=world,
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=exposed,
        offload_s=off,
        step_s=step,
        tokens_per_s_per_gpu=tokens_per_step / step if step else float("inf"),
        mfu=flops_per_step / step / (cluster.peak_tflops * 1e12) if step else 0.0,
        comm_to_compute=comm / compute if compute else float("inf"),
        compute_model="peak x efficiency" if phase_compute is None else "operators",
        hides_gathers=hid_f and hid_b,
        phase_comm_s=per_phase,
    )
