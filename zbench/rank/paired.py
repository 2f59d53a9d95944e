"""Paired timing: after a case has trained, steps of it and of a DDP copy of its model, alternating.

Why: a machine's speed drifts between minutes (other jobs, thermal limits, a
shared CI runner), so a step time compared with one measured in another run
mixes the code's change with the machine's. Two steps taken back to back on
the same ranks see the same machine; the ratio of the case's step to DDP's
cancels whatever changes more slowly than one round. ``zbench check`` gates on
that ratio (docs/methods.md#regression-gate), as ``tests/benchmarks`` does for
the engine's goals.

Note: this runs after the case's own steps, its memory peak, model-state bytes
and final parameters are taken, so the DDP copy changes none of them. The copy
needs room beside the case (that is why the case may be ZeRO at all): every
rank checks its free memory first, and all skip together when any is short.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from zbench.cases.case import REFERENCE, Case
from zbench.cases.formulas import expected_state_bytes
from zbench.cases.model_source import ModelInfo
from zbench.measure.memory import free_bytes
from zbench.measure.timing import timed
from zbench.protocol import Engine
from zbench.rank.training import build_engine, step_batches
from zbench.results.record import PairedTiming

WARMUP_ROUNDS = 2
"""Rounds dropped before timing: the DDP copy's first steps allocate its buckets and optimizer state."""

MAX_ROUNDS = 5000
"""However fast the steps, a case's paired phase stops here (a 10 s budget on a 1 ms step would be 5000 rounds)."""

HEADROOM = 2.0
"""The DDP copy is assumed to need this many times its model-state bytes (activations, buckets, allocator slack)."""


def reference_need_bytes(case: Case, parameters: int) -> int:
    """What a DDP copy of the model is expected to hold per rank (the ZeRO formula at stage 0, with headroom)."""
    state = expected_state_bytes(
        params=parameters,
        world=case.world_size,
        stage=0,
        precision=case.precision,
        optimizer=case.optimizer,
        momentum=case.momentum,
        master_weights=False,
    )
    return int(HEADROOM * sum(state.values()))


def every_rank_has_room(need: int, device: torch.device) -> bool:
    """True when every rank has ``need`` bytes free (one collective, so all ranks decide alike)."""
    short = torch.tensor([0 if free_bytes(device) >= need else 1], dtype=torch.int32, device=device)
    dist.all_reduce(short)
    return int(short.item()) == 0


def rank_zero_says_go_on(go_on: bool, device: torch.device) -> bool:
    """Rank 0's decision, on every rank: each rank's clock says something slightly different."""
    flag = torch.tensor([int(go_on)], dtype=torch.int32, device=device)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def time_paired_rounds(
    case: Case,
    engine: Engine,
    *,
    info: ModelInfo,
    rank: int,
    world: int,
    device: torch.device,
    swap_dir: str | None,
    after_step: Callable[[], Any] = lambda: None,
) -> PairedTiming:
    """Rounds of one step of ``engine`` and one of a fresh DDP copy, in alternating order: at least
    ``case.paired_rounds``, and more until ``case.paired_seconds`` have passed (at most ``MAX_ROUNDS``)."""
    if case.is_reference or case.noise_twin:
        return PairedTiming(skipped="the reference itself")
    need = reference_need_bytes(case, info.parameters)
    if not every_rank_has_room(need, device):
        return PairedTiming(skipped=f"a rank had less than {need / 2**30:.2f} GiB free for the DDP copy")
    try:
        return _rounds(
            case, engine, info=info, rank=rank, world=world, device=device, swap_dir=swap_dir, after_step=after_step
        )
    except Exception as exc:  # the case's own results stand; a failing peer surfaces here as a broken connection
        return PairedTiming(skipped=f"the paired rounds failed: {type(exc).__name__}: {exc}"[:500])


def _rounds(
    case: Case,
    engine: Engine,
    *,
    info: ModelInfo,
    rank: int,
    world: int,
    device: torch.device,
    swap_dir: str | None,
    after_step: Callable[[], Any],
) -> PairedTiming:
    reference_case = case.model_copy(update={"implementation": REFERENCE, "stage": 0, "offload": "none", "options": {}})
    _, reference = build_engine(reference_case, device, swap_dir)
    engines = {"case": engine, "reference": reference}
    times: dict[str, list[float]] = {"case": [], "reference": []}
    started = time.perf_counter()
    try:
        for i in range(MAX_ROUNDS):
            if i >= WARMUP_ROUNDS + case.paired_rounds and not rank_zero_says_go_on(
                time.perf_counter() - started < case.paired_seconds, device
            ):
                break
            micro_batches = step_batches(case, info, case.steps + i, rank=rank, world=world, device=device)
            order = ("case", "reference") if i % 2 == 0 else ("reference", "case")
            for name in order:
                _, seconds = timed(partial(engines[name].step, micro_batches), device=device, barrier=dist.barrier)
                after_step()
                if i >= WARMUP_ROUNDS:
                    times[name].append(seconds)
    finally:
        reference.close()
    return PairedTiming(case_s=times["case"], reference_s=times["reference"])
