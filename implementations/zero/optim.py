"""The optimizer over this rank's fp32 master shards, with clipping and loss scaling computed across the group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zbench.implementations._common import sum_of_squares
from zbench.implementations.zero.comm import Comm
from zbench.implementations.zero.masters import MasterStore
from zbench.implementations.zero.precision import LossScaler
from zbench.protocol import TrainSpec


class ShardedOptimizer:
    """Unscaling, the global gradient norm, clipping and loss-scale bookkeeping; the step itself is the master store's.

    Note: torch's AdamW and SGD are elementwise, so stepping flat shards is exactly stepping each
    parameter; only the gradient norm needs the whole group, which costs one all-reduce of a scalar
    (every step: the harness compares it with DDP's, docs/methods.md#equivalence). Zero padding
    stays zero: its gradient is zero and weight decay of zero is zero.
    """

    def __init__(self, masters: MasterStore, *, spec: TrainSpec, comm: Comm, scaler: LossScaler) -> None:
        self.masters = masters
        self.device = spec.device
        self.comm = comm
        self.scaler = scaler
        self.clip = spec.grad_clip
        self.last_grad_norm: torch.Tensor | None = None

    def step(self, grads: Sequence[torch.Tensor], *, skip: Sequence[set[int]] | None = None) -> bool:
        """Unscale, clip and apply this rank's gradient shards (one per group, group-mean); False if skipped.

        The shards live where the master store steps (``masters.home``). fp32 gradients are
        modified in place; others are up-cast to fp32 copies first. ``skip``: per group, the parameters
        no rank used this step, which the store leaves untouched (``unused``).
        """
        grads = [g.float() for g in grads]
        if self.scaler.enabled:
            inv_scale = 1.0 / self.scaler.scale
            for g in grads:
                g.mul_(inv_scale)
        norm = self._global_norm(grads)
        self.last_grad_norm = norm
        if self.scaler.enabled:
            overflow = not torch.isfinite(norm).item()
            self.scaler.update(overflow)
            if overflow:
                return False
        if self.clip is not None:
            coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s arithmetic
            for g in grads:
                g.mul_(coef.to(g.device))
        self.masters.step(grads, skip=skip)
        return True

    def _global_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of the whole model's gradient: local sums of squares, summed over the group."""
        sq = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        for g in grads:
            sq += sum_of_squares(g)
        # host shards: the collective runs on the device; a float32 scalar, as before (the traced traffic)
        return self.comm.all_reduce_sum(sq.float().to(self.device)).sqrt()

    def metrics(self) -> dict[str, float]:
        return {} if self.last_grad_norm is None else {"grad_norm": float(self.last_grad_norm)}

    def state_dict(self) -> dict:
        return {**self.masters.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore masters, optimizer state and loss scale; the compute shards are rewritten from the masters."""
        self.masters.load_state_dict(state)
        self.scaler.load_state_dict(state["scaler"])
