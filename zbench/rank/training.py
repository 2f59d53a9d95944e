"""What every training run on a rank starts from: the case's model and engine, and the batches of each step.

The case's own run (``zbench.rank.worker``), the paired DDP copy (``zbench.rank.paired``) and the fp32 probe
(``zbench.rank.probe``) all train this way, so that they see the same model, wrapping and data.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.model_source import ModelInfo, build
from zbench.cases.models import checkpoint_blocks, rank_micro_batches, synthetic_batch
from zbench.protocol import Engine, MicroBatch


def check_engine(engine: object, name: str) -> Engine:
    """The engine an implementation built, checked against the protocol (a plug-in may lack a member)."""
    missing = [m for m in ("step", "full_parameters", "state_bytes", "metrics", "close") if not hasattr(engine, m)]
    if missing:
        raise TypeError(
            f"implementation {name!r} built an engine without {', '.join(missing)} "
            "(see zbench.protocol.Engine; zbench.protocol.EngineBase supplies metrics and close)"
        )
    return engine  # type: ignore[return-value]  # checked member by member above


def build_engine(case: Case, device: torch.device, swap_dir: str | None) -> tuple[nn.Module, Engine]:
    """The case's model (seeded, block checkpointing applied when asked) and its implementation's engine."""
    model = build(case.model, seed=case.seed, device=device)
    if case.activation_checkpointing:
        checkpoint_blocks(model)
    built = registry.resolve(case.implementation).build(
        model, case.train_spec(device, swap_dir=swap_dir), dist.group.WORLD
    )
    return model, check_engine(built, case.implementation)


def step_batches(
    case: Case, info: ModelInfo, step: int, *, rank: int, world: int, device: torch.device
) -> list[MicroBatch]:
    """This rank's micro-batches of the global batch of ``step`` (seeded by the case)."""
    rows = case.micro_batch * case.grad_accum * world
    batch = synthetic_batch(info, seed=case.seed, step=step, rows=rows, seq=case.seq_len)
    return rank_micro_batches(batch, rank=rank, world=world, grad_accum=case.micro_batches_per_step, device=device)
