"""One micro-batch's forward and backward, the same for every stage (and the same arithmetic as the DDP adapter)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zbench.implementations._common import autocast
from zbench.implementations.zero.precision import LossScaler
from zbench.protocol import MicroBatch, TrainSpec


def forward_backward(
    model: nn.Module,
    batch: MicroBatch,
    *,
    spec: TrainSpec,
    scaler: LossScaler,
    n: int,
    before_backward: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Forward under autocast (a no-op in fp32), backward of the scaled ``loss / n``; returns the unscaled loss.

    ``before_backward(loss)`` runs between the two (``unused.Usage`` looks there for parameters the graph
    does not reach)."""
    with autocast(spec):
        loss = model(*batch)
    if before_backward is not None:
        before_backward(loss)
    scaler.scale_loss(loss / n).backward()
    return loss
