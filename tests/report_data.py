"""Stored runs made of synthetic records, for report tests: as many cases as asked, with a baseline run before them.

The records carry what real ones do (every step, memory, model state by category and location, the
communication ledger, equivalence checks), with figures that differ between setups, so the report has
something to sort, mark and compare; ``slower`` and ``fatter`` plant regressions against the baseline.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from tests.conftest import make_case
from zbench.results.record import (
    CaseRecord,
    Check,
    CommSummary,
    Equivalence,
    MemorySummary,
    ModelState,
    OpVolume,
    RankMemory,
    StepSample,
    StepTimeSummary,
)
from zbench.results.run_info import Environment, RunInfo, SuiteInfo
from zbench.results.store import RunDir
from zbench.values import CATEGORIES, LOCATIONS

MODELS = ("tiny", "small", "medium", "large", "xl")
SETUPS = (
    ("ddp", 0, "none"), ("zero1", 1, "none"), ("zero1", 1, "optimizer"), ("zero2", 2, "none"),
    ("zero2", 2, "optimizer"), ("zero3", 3, "none"), ("zero3", 3, "optimizer+params"), ("zero3", 3, "nvme"),
    ("fsdp", 3, "none"), ("torch_zero", 1, "none"),
)  # fmt: skip
WORLDS = (2, 4, 8, 16, 32)
PRECISIONS = ("fp32", "bf16")
STEPS = 12


def _record(config_fields: dict, rng: random.Random, time_scale: float, memory_scale: float) -> CaseRecord:
    stage, offload = config_fields["stage"], config_fields["offload"]
    case = make_case(**config_fields)
    base_time = 0.05 * (1 + MODELS.index(case.model)) * (1 + 0.15 * stage + (0.6 if offload != "none" else 0))
    times = [base_time * time_scale * rng.uniform(0.97, 1.03) for _ in range(STEPS)]
    state = int(2**24 * (1 + MODELS.index(case.model)) * (4 - stage) / 4 * memory_scale)
    measured = {c: dict.fromkeys(LOCATIONS, 0) for c in CATEGORIES}
    for i, category in enumerate(CATEGORIES):
        measured[category]["host" if offload != "none" and i >= 2 else "device"] = state // len(CATEGORIES)
    total = sum(sum(v.values()) for v in measured.values())
    elements = 2**20 * (1 + stage)
    timed = sorted(times[2:])
    median = timed[len(timed) // 2]
    return CaseRecord(
        config=case,
        status="ok",
        model_parameters=2**20,
        steps=[
            StepSample(step=i, loss=4.0 - 0.1 * i + 1e-4 * rng.random(), step_time_s=t, warmup=i < 2)
            for i, t in enumerate(times)
        ],
        summary=StepTimeSummary(
            step_time_median_s=median,
            step_time_iqr_s=timed[-3] - timed[2],
            step_time_q1_s=timed[2],
            step_time_q3_s=timed[-3],
            tokens_per_s=case.tokens_per_step / median,
            tokens_per_s_per_rank=case.tokens_per_step / median / case.world_size,
        ),
        memory=MemorySummary(
            kind="cuda_allocated",
            peak_bytes=int(total * 1.6),
            per_rank=[RankMemory(kind="cuda_allocated", bytes=int(total * 1.6)) for _ in range(case.world_size)],
        ),
        model_state=ModelState(measured=measured, measured_total=total, expected_total=float(total)),
        comms=CommSummary(
            elements_per_step=elements,
            bytes_per_step=elements * 4,
            per_step_elements=[elements] * STEPS,
            by_op={"all_reduce": OpVolume(count=3, elements=elements, bytes=elements * 4)},
            expected_elements=elements,
            design_elements=elements,
            error_rel=0.0,
        ),
        equivalence=Equivalence(
            equivalent=True,
            checks=[Check(name="loss", passed=True, figure=1e-7, bound=1e-5, noise=1e-6, detail="step 3")],
            max_rel_loss_diff=1e-7,
        ),
        ratio_to_ddp=1 + 0.15 * stage,
        wall_s=sum(times) + 3,
    )


def configurations(count: int) -> list[dict]:
    grid = itertools.product(MODELS, WORLDS, PRECISIONS, SETUPS)
    out = []
    for model, world, precision, (implementation, stage, offload) in itertools.islice(grid, count):
        out.append(
            dict(model=model, world_size=world, precision=precision, implementation=implementation, stage=stage,
                 offload=offload, device="cuda", micro_batch=1, seq_len=1024)
        )  # fmt: skip
    return out


def stored_run(
    root: Path,
    run_id: str,
    count: int,
    *,
    started_at: str,
    slower: frozenset[int] = frozenset(),
    fatter: frozenset[int] = frozenset(),
    seed: int = 0,
    extra: tuple[CaseRecord, ...] = (),
) -> RunDir:
    """A finished run of ``count`` cases (ok, equivalent) plus ``extra``; case ``i`` in ``slower`` takes 30% longer,
    in ``fatter`` holds 30% more memory."""
    rng = random.Random(seed)
    run = RunDir(root, run_id)
    env = Environment(zbench_version="synthetic", torch="2.13.0", python="3.11", host="bench", cpu_count=64,
                      gpus=["NVIDIA H100"] * 8, cuda_version="12.8")  # fmt: skip
    records = [
        _record(fields, rng, 1.3 if i in slower else 1.0, 1.3 if i in fatter else 1.0)
        for i, fields in enumerate(configurations(count))
    ]
    for r in records:  # every case compares with its model's DDP
        ddp = next(x for x in records if x.config.implementation == "ddp" and x.config.model == r.config.model)
        r.equivalence.reference_case = ddp.case_id  # type: ignore[union-attr]
    records += list(extra)
    info = RunInfo(
        run_id=run_id,
        suite=SuiteInfo(name="synthetic", sha256="0" * 64, config={"warmup_steps": 2}),
        environment=env,
        started_at=started_at,
        case_order=[r.case_id for r in records],
    )
    run.start(info)
    for r in records:
        run.write_case(r.model_copy(update={"run_id": run_id}))
    run.finish()
    return run
