"""Every allowed value set, declared once: precisions, offload modes, ZeRO stages, case statuses.

The ``Literal`` types are what the suite schema, the protocol and the records
validate against; the tuples (read off the same types) are what messages,
``--help`` choices and loops list. Adding a value here is the whole change.
"""

from __future__ import annotations

from typing import Literal, get_args

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)

Offload = Literal["none", "optimizer", "optimizer+params", "nvme"]
OFFLOAD_MODES: tuple[Offload, ...] = get_args(Offload)

Stage = Literal[0, 1, 2, 3]
"""ZeRO stage; 0 is plain data parallelism (DDP)."""
STAGES: tuple[Stage, ...] = get_args(Stage)

Status = Literal["ok", "skipped", "error", "oom", "timeout"]
"""How a case ended: ``ok`` ran to the end; ``skipped`` never ran (the reason is stored); the rest failed."""
STATUSES: tuple[Status, ...] = get_args(Status)
FAILED_STATUSES: tuple[Status, ...] = ("error", "oom", "timeout")

OptimizerName = Literal["adamw", "sgd"]
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)


def optimizer_bytes_per_param(optimizer: str, momentum: float = 0.0) -> int:
    """Optimizer state per parameter, fp32: AdamW's two moments 8, SGD's momentum buffer 4, plain SGD none."""
    if optimizer == "adamw":
        return 8
    return 4 if momentum else 0


DeviceKind = Literal["cpu", "cuda"]
DEVICE_KINDS: tuple[DeviceKind, ...] = get_args(DeviceKind)

Category = Literal["parameters", "gradients", "optimizer_state", "master_weights"]
"""Model-state categories an engine reports in ``state_bytes``."""
CATEGORIES: tuple[Category, ...] = get_args(Category)

Location = Literal["device", "host", "disk"]
"""Where a byte of model state lives."""
LOCATIONS: tuple[Location, ...] = get_args(Location)
