"""What DeepSpeed's ZeRO holds between steps, by category and location, where it departs from the ZeRO formulas.

Read from DeepSpeed 0.19's optimizers (``runtime/zero/stage_1_and_2.py``, ``runtime/bf16_optimizer.py``,
``runtime/zero/stage3.py``) and held to 2% of the bytes its tensors hold after training (tests/test_deepspeed.py).
With Ψ parameters, N ranks, L bytes per compute element (4 fp32, 2 bf16) and AdamW's 8 bytes of state:

- **master weights**: a separate fp32 partition (4Ψ/N) at every precision. In fp32 the ZeRO formulas count
  none, but DeepSpeed clones the partition all the same (``single_partition_of_fp32_groups``).
- **gradients** held between steps:
  - stages 1-2 free theirs after the step: 0;
  - bf16 at stage 1 without offload trains with ``BF16_Optimizer``, which keeps the whole fp32 gradient
    (4Ψ);
  - with optimizer offload, stages 1-2 keep the fp32 gradient partition on the host (4Ψ/N), plus two
    buffers the size of the largest parameter in compute precision (host and device); at stage 2 with
    gradient accumulation and no fp32 accumulation partition (fp32 training), a host accumulation buffer
    for every parameter that overlaps the rank's partition, whole, in compute precision;
  - stage 3 keeps a flat gradient partition in the accumulation dtype (4Ψ/N; the harness accumulates in
    fp32). It lives on the device, or on the host with offload, where the master's own gradient adds
    another 4Ψ/N.
- **parameters**: whole (LΨ) at stages 1-2. With optimizer offload they add a host staging copy of the
  partition (LΨ/N). At stage 3 each rank keeps its shard (LΨ/N) and also keeps whole every parameter of at
  most ``stage3_param_persistence_threshold`` elements (default 100,000: biases and norms at scale,
  every parameter of a toy model).
- **optimizer state**: the formulas' K·Ψ/N, on the host with offload.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from zbench.values import CATEGORIES, LOCATIONS

#: DeepSpeed's defaults for the stage-3 persistence thresholds (``DeepSpeedZeroConfig``).
PARAM_PERSISTENCE_DEFAULT = 100_000
MODEL_PERSISTENCE_DEFAULT = sys.maxsize


def persistent_elements(sizes: Sequence[int], world: int, zero: dict[str, Any]) -> int:
    """Elements of the parameters stage 3 keeps whole on every rank: each at most the parameter threshold, in
    order, while their running total stays within the model threshold's share per rank (``partition_parameters``)."""
    limit = int(zero.get("stage3_param_persistence_threshold", PARAM_PERSISTENCE_DEFAULT))
    model_limit = int(zero.get("stage3_model_persistence_threshold", MODEL_PERSISTENCE_DEFAULT)) // world
    total = 0
    for size in sizes:
        if size <= limit and total + size <= model_limit:
            total += size
    return total


def widest_partition_overlap(sizes: Sequence[int], world: int) -> int:
    """Elements of the parameters that overlap one rank's partition of the flat group, whole, on the rank where
    they are most (stages 1-2 partition the parameters flattened in order; one may straddle two ranks)."""
    part = math.ceil(sum(sizes) / world)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return max(
        sum(
            size
            for start, size in zip(starts, sizes, strict=True)
            if start < (r + 1) * part and start + size > r * part
        )
        for r in range(world)
    )


def deepspeed_layout(
    *,
    sizes: Sequence[int],
    world: int,
    stage: int,
    precision: str,
    offload: str,
    optimizer_bytes: int,
    grad_accum: int,
    config: dict[str, Any],
) -> dict[str, dict[str, float]]:
    """Bytes per rank by category and location (see the module docstring) for the DeepSpeed ``config`` the
    harness runs (``deepspeed_zero.deepspeed_config``); ``sizes`` are the parameters' element counts."""
    params = sum(sizes)
    low = 4 if precision == "fp32" else 2
    shard = sum(math.ceil(s / world) for s in sizes) if stage == 3 else math.ceil(params / world)
    offloaded = offload != "none"
    tier = "host" if offloaded else "device"
    accum = 2 if config.get("data_types", {}).get("grad_accum_dtype") in ("bf16", "fp16") else 4
    out: dict[str, dict[str, float]] = {c: {loc: 0.0 for loc in LOCATIONS} for c in CATEGORIES}
    out["master_weights"][tier] = 4.0 * shard
    out["optimizer_state"][tier] = float(optimizer_bytes * shard)
    if stage == 3:
        out["parameters"]["host" if offload == "optimizer+params" else "device"] = float(low * shard)
        out["parameters"]["device"] += low * persistent_elements(sizes, world, config.get("zero_optimization", {}))
        out["gradients"][tier] = float(accum * shard)
        if offloaded:
            out["gradients"]["host"] += 4.0 * shard
        return out
    out["parameters"]["device"] = float(low * params)
    if offloaded:
        out["parameters"]["host"] = float(low * shard)
        out["gradients"]["host"] = 4.0 * shard + low * max(sizes)
        out["gradients"]["device"] = float(low * max(sizes))
        compact = accum == 4 and low != 4  # bf16 accumulates into an fp32 partition instead (freed at the step)
        if stage == 2 and grad_accum > 1 and not compact:
            out["gradients"]["host"] += low * widest_partition_overlap(sizes, world)
    elif stage == 1 and precision == "bf16" and accum == 4:
        out["gradients"]["device"] = 4.0 * params  # BF16_Optimizer's whole fp32 gradient
    return out
