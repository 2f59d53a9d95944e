"""The ZeRO paper's per-rank model-state formulas (docs/methods.md), by category.

Ψ parameters, N data-parallel ranks. ``stage`` 0 is plain data parallelism
(DDP). For fp32 training a parameter costs params 4 + grads 4 + optimizer K
(AdamW 8, SGD with momentum 4, plain SGD 0) bytes; in mixed precision
(bf16/fp16 compute copy with fp32 master weights) it costs params 2 + grads 2
+ master 4 + optimizer K.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zbench.cases.model_source import model_info
from zbench.values import optimizer_bytes_per_param

if TYPE_CHECKING:
    from zbench.cases.case import Case


def expected_state_bytes(
    *,
    params: int,
    world: int,
    stage: int,
    precision: str,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    master_weights: bool | None = None,
    shard_elements: float | None = None,
) -> dict[str, float]:
    """Predicted bytes per rank by category for one rank of ``world``.

    ``master_weights`` says whether the implementation keeps a low-precision
    compute copy plus fp32 master weights (the ZeRO layout); ``None`` means
    "whenever precision is not fp32". Autocast-based trainers (DDP, FSDP2 with
    fp32 parameters) keep fp32 parameters and gradients and no separate master.
    """
    if master_weights is None:
        master_weights = precision != "fp32"
    low = 2 if master_weights else 4
    k = optimizer_bytes_per_param(optimizer, momentum)
    shard = shard_elements / params if shard_elements is not None else 1.0 / world
    p_frac = shard if stage >= 3 else 1.0
    g_frac = shard if stage >= 2 else 1.0
    o_frac = shard if stage >= 1 else 1.0
    return {
        "parameters": low * params * p_frac,
        "gradients": low * params * g_frac,
        "optimizer_state": k * params * o_frac,
        "master_weights": (4 * params * o_frac) if master_weights else 0.0,
    }


def offload_supported(stage: int, offload: str) -> str | None:
    """Why ``offload`` cannot be combined with ``stage``, or ``None`` (ZeRO-Offload needs a sharded optimizer;
    parameters can only live off the device when they are partitioned, i.e. at stage 3)."""
    if offload != "none" and stage == 0:
        return "offload needs ZeRO (stage 1-3); DDP keeps everything on the device"
    if offload == "optimizer+params" and stage != 3:
        return "parameter offload needs stage 3 (partitioned parameters)"
    return None


def placement(
    *,
    params: int,
    world: int,
    stage: int,
    precision: str,
    offload: str,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    master_weights: bool | None = None,
    offload_master: bool = True,
    shard_elements: float | None = None,
) -> dict[str, dict[str, float]]:
    """Predicted bytes per rank by category *and location* (device, host, disk).

    Without offload this is ``expected_state_bytes``, all on the device. With
    offload (ZeRO-Offload, ZeRO-Infinity), the optimizer step runs on the host
    over fp32 copies, so whatever the compute precision:

    - optimizer state and fp32 master weights (Ψ/N each; in fp32 training the
      master is a host copy of the parameter shard, a tensor of its own) live
      on the host, or on disk for ``nvme``;
    - the optimizer's fp32 gradient partition (4·Ψ/N) lives on the host; at
      stage 1 the device also keeps its full gradients (it reduces them after
      backward), at stages 2-3 the device keeps none between steps (buckets are
      reduce-scattered and copied out as backward runs);
    - parameters stay on the device, except at stage 3 where the partitioned
      parameters move to the host (``optimizer+params``) or to disk (``nvme``).

    ``offload_master=False`` describes offload that keeps no separate master:
    FSDP2's CPU offload keeps the fp32 parameter shard on the host and steps it
    in place (with ``master_weights=False`` its parameters count 4 bytes).
    """
    by_cat = expected_state_bytes(
        params=params,
        world=world,
        stage=stage,
        precision=precision,
        optimizer=optimizer,
        momentum=momentum,
        master_weights=master_weights,
        shard_elements=shard_elements,
    )
    out = {c: {"device": 0.0, "host": 0.0, "disk": 0.0} for c in by_cat}
    if offload == "none":
        for cat, b in by_cat.items():
            out[cat]["device"] = b
        return out
    shard = shard_elements if shard_elements is not None else params / world
    optim_loc = "disk" if offload == "nvme" else "host"
    out["optimizer_state"][optim_loc] = by_cat["optimizer_state"]
    out["master_weights"][optim_loc] = 4 * shard if offload_master else 0.0
    out["gradients"]["host"] = 4 * shard
    if stage == 1:
        out["gradients"]["device"] = by_cat["gradients"]
    param_loc = {"optimizer+params": "host", "nvme": "disk"}.get(offload, "device") if stage == 3 else "device"
    out["parameters"][param_loc] = by_cat["parameters"]
    return out


def placement_for(case: Case) -> dict[str, dict[str, float]]:
    """``placement`` for one suite case, with the layout its implementation declares (master weights kept in
    mixed precision, a separate master when offloading, parameters sharded between steps below stage 3, each
    parameter split by rows), for its fullest rank."""
    caps = case.capabilities
    if caps is None:
        raise ValueError(f"case {case.case_id} carries no capabilities (a schema-1 record); nothing to predict")
    info = model_info(case.model)
    by_rows = info.shape.row_shard_elements(case.world_size) if caps.shards_parameters_by_rows else None

    def at(stage: int) -> dict[str, dict[str, float]]:
        return placement(
            params=info.parameters,
            world=case.world_size,
            stage=stage,
            precision=case.precision,
            offload=case.offload,
            optimizer=case.optimizer,
            momentum=case.momentum,
            master_weights=caps.keeps_master_weights and case.precision != "fp32",
            offload_master=caps.offload_keeps_master,
            shard_elements=by_rows,
        )

    out = at(case.stage)
    if caps.parameters_sharded_from_stage <= case.stage < 3:
        out["parameters"] = at(3)["parameters"]
    return out
