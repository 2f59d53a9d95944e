"""``zbench run --dry-run``: what a suite would run on this machine, and whether each case would fit, without
running anything.

Each case is listed with its skip reason, or with ``zbench plan``'s fit check: the model-state bytes it
would hold on the compute device per rank (its implementation's declared layout, else the ZeRO formulas),
plus stage 3's working set, against this machine's memory per rank with plan's 20% kept free for
activations. A GPU rank has its GPU's memory; CPU ranks share the host's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from zbench.cases.case import Case
from zbench.cases.model_source import model_info
from zbench.plan.memory import usable_bytes, working_set_bytes
from zbench.run.aggregate import declared_layout


@dataclass(frozen=True)
class DryRow:
    case: Case
    device_bytes: float | None
    """Predicted bytes on the compute device per rank; ``None`` for a skipped case."""
    capacity_bytes: float | None
    """Usable memory per rank (after the reserve), ``None`` when unknown."""

    @property
    def fits(self) -> bool | None:
        if self.device_bytes is None or self.capacity_bytes is None:
            return None
        return self.device_bytes <= self.capacity_bytes


def memory_per_rank(device: str, ranks_here: int) -> float | None:
    """Usable bytes per rank: the GPU's memory, or the host's shared by the ranks on it; after plan's reserve."""
    if device == "cuda":
        import torch

        total = float(torch.cuda.get_device_properties(0).total_memory)
    else:
        try:
            total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks_here
        except (ValueError, OSError, AttributeError):  # not a POSIX host
            return None
    return usable_bytes(total)


def predicted_device_bytes(case: Case) -> float:
    """Model states on the compute device (declared layout or formulas) plus stage 3's working set."""
    layout, _ = declared_layout(case)
    states = sum(locs["device"] for locs in layout.values())
    info = model_info(case.model)
    work = working_set_bytes(info.gpt or info.arch, case.precision) if case.stage == 3 else 0.0
    return states + work


def describe(cases: tuple[Case, ...], nnodes: int = 1) -> list[DryRow]:
    """One row per case, in suite order; each case's ranks spread evenly over ``nnodes`` nodes like this one."""
    return [
        DryRow(
            case,
            None if case.skip_reason else predicted_device_bytes(case),
            memory_per_rank(case.device, max(1, case.world_size // nnodes)),
        )
        for case in cases
    ]
