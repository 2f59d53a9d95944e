"""The optimizer over this rank's fp32 master shards, with clipping and loss scaling computed across the group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from implementations.zero.comm import Comm
from implementations.zero.precision import LossScaler
from zbench.protocol import TrainSpec


class ShardedGroup(Protocol):
    shard: torch.Tensor
    """This rank's slice of the group's parameters, in the compute dtype."""
    master: torch.Tensor
    """Its fp32 master copy (``shard`` itself when the compute dtype is fp32)."""


class ShardedOptimizer:
    """``spec.make_optimizer`` over the master shards: one flat tensor per group, one step per rank.

    Note: torch's AdamW and SGD are elementwise, so stepping flat shards is exactly stepping each
    parameter; only the gradient norm needs the whole group, which costs one all-reduce of a scalar
    (done only when clipping or loss scaling needs it). Zero padding stays zero: its gradient is
    zero and weight decay of zero is zero.
    """

    def __init__(self, groups: Sequence[ShardedGroup], *, spec: TrainSpec, comm: Comm, scaler: LossScaler) -> None:
        self.shards = [g.shard for g in groups]
        self.masters = [g.master for g in groups]
        self.comm = comm
        self.scaler = scaler
        self.clip = spec.grad_clip
        self.optimizer = spec.make_optimizer(self.masters)
        self.last_grad_norm: float | None = None

    @property
    def separate_masters(self) -> list[torch.Tensor]:
        """The master shards that are tensors of their own (mixed precision), for state accounting."""
        return [m for m, s in zip(self.masters, self.shards) if m is not s]

    def step(self, grads: Sequence[torch.Tensor]) -> bool:
        """Unscale, clip and apply this rank's gradient shards (one per group, group-mean); False if skipped.

        fp32 gradients are modified in place; others are up-cast to fp32 copies first.
        """
        grads = [g.float() for g in grads]
        if self.scaler.enabled:
            inv_scale = 1.0 / self.scaler.scale
            for g in grads:
                g.mul_(inv_scale)
        norm = self._global_norm(grads) if self.clip is not None or self.scaler.enabled else None
        self.last_grad_norm = None if norm is None else float(norm)
        if self.scaler.enabled:
            overflow = not torch.isfinite(norm).item()
            self.scaler.update(overflow)
            if overflow:
                return False
        if self.clip is not None:
            coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s arithmetic
            for g in grads:
                g.mul_(coef)
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.optimizer.step()
        for m, s in zip(self.masters, self.shards):
            m.grad = None
            if m is not s:
                s.copy_(m)
        return True

    def _global_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of the whole model's gradient: local sums of squares, summed over the group."""
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for g in grads:
            sq += torch.linalg.vector_norm(g) ** 2
        return self.comm.all_reduce_sum(sq).sqrt()

    def metrics(self) -> dict[str, float]:
        return {} if self.last_grad_norm is None else {"grad_norm": self.last_grad_norm}

    def state_dict(self) -> dict:
        return {"masters": [m.detach().clone() for m in self.masters], "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore masters, optimizer state and loss scale; the compute shards are rewritten from the masters."""
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"checkpoint has {len(state['masters'])} master shards, this engine {len(self.masters)}")
        for m, s, saved in zip(self.masters, self.shards, state["masters"]):
            if saved.shape != m.shape:
                raise ValueError(f"checkpoint master shard has shape {tuple(saved.shape)}, expected {tuple(m.shape)}")
            m.copy_(saved)
            if m is not s:
                s.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
