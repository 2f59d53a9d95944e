"""``zbench plan``: memory per GPU and per host for every stage × offload mode, from the ZeRO formulas, before running.

Model states come from ``zbench.cases.formulas``. On top, stage 3 needs a working set
on the device: the parameters of the unit being computed and of the prefetched
next one, gathered in full, plus that unit's full gradient before it is
reduce-scattered. Activations, temporary buffers and fragmentation are not
modelled: ``reserve`` keeps that share of each GPU free for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from zbench.cases.formulas import offload_supported, placement
from zbench.values import OFFLOAD_MODES, STAGES

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass(frozen=True)
class PlanRow:
    stage: int
    offload: str
    device_bytes: float
    host_bytes_per_rank: float
    host_bytes_per_node: float
    disk_bytes_per_rank: float
    model_state_device_bytes: float
    working_set_bytes: float
    fits: bool | None
    note: str = ""

    @property
    def name(self) -> str:
        return STAGE_NAMES[self.stage] + ("" if self.offload == "none" else f" + offload {self.offload}")


class Units(Protocol):
    """What the working set needs of a model: a preset's ``GPTConfig`` or an architecture's ``HFArch``."""

    @property
    def largest_unit_parameters(self) -> int: ...


def working_set_bytes(cfg: Units | None, precision: str) -> float:
    """Stage 3's gathered parameters (current + prefetched block) and one block's full gradient."""
    if cfg is None:
        return 0.0
    low = 4 if precision == "fp32" else 2
    return 3 * cfg.largest_unit_parameters * low


#: Share of each rank's memory kept free for activations and buffers, which the plan does not model.
DEFAULT_RESERVE = 0.2


def usable_bytes(memory_bytes: float, reserve: float = DEFAULT_RESERVE) -> float:
    """What the model states and the stage-3 working set may take of a rank's memory."""
    return memory_bytes * (1 - reserve)


def plan(
    *,
    params: int,
    gpus: int,
    precision: str = "bf16",
    gpu_memory_bytes: float | None = None,
    gpus_per_node: int | None = None,
    reserve: float = DEFAULT_RESERVE,
    cfg: Units | None = None,
    optimizer: str = "adamw",
) -> list[PlanRow]:
    """Every stage × offload combination; ``fits`` is ``None`` when no GPU memory was given."""
    per_node = gpus_per_node or gpus
    rows = []
    for stage in STAGES:
        for offload in OFFLOAD_MODES:
            if offload_supported(stage, offload):
                continue
            place = placement(
                params=params, world=gpus, stage=stage, precision=precision, offload=offload, optimizer=optimizer
            )
            loc = {where: sum(c[where] for c in place.values()) for where in ("device", "host", "disk")}
            work = working_set_bytes(cfg, precision) if stage == 3 else 0.0
            device = loc["device"] + work
            fits = None if gpu_memory_bytes is None else device <= usable_bytes(gpu_memory_bytes, reserve)
            rows.append(
                PlanRow(
                    stage, offload, device, loc["host"], loc["host"] * per_node, loc["disk"], loc["device"], work, fits
                )
            )
    return rows


def as_json(rows: list[PlanRow], **header: Any) -> dict[str, Any]:
    return {**header, "rows": [{**asdict(r), "name": r.name} for r in rows]}
