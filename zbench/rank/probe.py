"""The fp32 probe: a bf16 case's implementation trained again in fp32 by the same ranks, for the fp32 verdict.

Why: in bf16 the equivalence bounds come from the noise twin, whose other micro-batch split moves near-zero
tensors by tens of percent, so a logic bug that moves parameters by a few percent (a 0.1% learning-rate error,
weight decay skipped on biases and norms, one tensor stepping on a stale gradient) stays inside them; the same
bug in fp32 is caught a hundred times over. The probe trains the same implementation, options, offload, model
and batches in fp32 right after the bf16 run (in the same processes and process group: no second launch), and
the runner judges it against the group's fp32 DDP reference and twin with the fp32 bounds
(``zbench.verdicts.equivalence.probe_checks``; docs/methods.md#bf16-verdicts). Bugs that live only in the bf16
path (bf16 masters, a bf16 reduction, loss scaling) are the bf16 run's own checks' to catch.

Note: it runs after the case's steps, memory peak, model-state bytes and final parameters are taken, and after
its engine is closed, so it changes none of the case's figures; ``seconds`` is its cost.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from zbench.atomic import atomic_torch_save
from zbench.cases.case import Case
from zbench.cases.model_source import ModelInfo
from zbench.launch.handoff import ProbeResult
from zbench.rank.checksum import checksum
from zbench.rank.training import build_engine, step_batches


def probe_case(case: Case) -> Case:
    """The case the probe trains: the same in every respect but its precision."""
    return case.model_copy(update={"precision": "fp32", "fp32_probe": False, "paired_rounds": 0, "profile_steps": []})


def run_fp32_probe(
    case: Case,
    *,
    info: ModelInfo,
    rank: int,
    world: int,
    device: torch.device,
    swap_dir: str | None,
    params_path: Path,
) -> ProbeResult:
    """Train ``probe_case(case)`` on the case's batches for its steps (the first ``case.probe_steps`` when the
    suite caps them); rank 0 writes the final parameters to ``params_path``."""
    start = time.perf_counter()
    fp32 = probe_case(case)
    _, engine = build_engine(fp32, device, swap_dir)
    losses: list[float] = []
    grad_norms: list[float | None] = []
    try:
        for step in range(fp32.probe_steps or fp32.steps):
            micro_batches = step_batches(fp32, info, step, rank=rank, world=world, device=device)
            losses.append(float(engine.step(micro_batches)))
            grad_norms.append(engine.metrics().get("grad_norm"))
        params = engine.full_parameters()
    finally:
        engine.close()
    if rank == 0:
        atomic_torch_save(params, params_path)
    digest = checksum(params)
    dist.barrier()
    return ProbeResult(losses=losses, grad_norms=grad_norms, param_checksum=digest, seconds=time.perf_counter() - start)
