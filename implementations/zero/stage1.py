"""ZeRO stage 1: optimizer state and fp32 master weights sharded; parameters and gradients whole on every rank."""

from __future__ import annotations

import os

import torch
from torch import nn

from implementations._common import accumulate
from implementations.zero import checkpoint
from implementations.zero.comm import Comm
from implementations.zero.loop import forward_backward
from implementations.zero.optim import ShardedOptimizer
from implementations.zero.options import ZeroOptions
from implementations.zero.params import ReplicatedParams
from implementations.zero.precision import LossScaler
from implementations.zero.state import gather_full_parameters, zero_state_bytes
from zbench.protocol import MicroBatch, TrainSpec


class ZeRO1Engine:
    """One flat parameter buffer and one flat gradient buffer, whole on every rank; the optimizer sees only this rank's slice.

    The parameters' ``.grad`` are views of the gradient buffer, so autograd accumulates every
    micro-batch straight into it; once per step it is reduce-scattered (in place: each rank's slice
    receives the group sum), each rank steps its fp32 slice, and an in-place all-gather brings every
    rank's updated slice back into every rank's parameters.
    """

    stage = 1

    def __init__(self, model: nn.Module, spec: TrainSpec, group) -> None:
        self.model, self.spec = model, spec
        self.options = ZeroOptions.from_spec(spec)
        self.comm = Comm(group)
        self.names = [name for name, _ in model.named_parameters()]
        self.params = ReplicatedParams(list(model.named_parameters()), comm=self.comm, dtype=spec.compute_dtype)
        self.grads = torch.zeros_like(self.params.flat)
        for p, g in zip(self.params.params, self.params.layout.views(self.grads)):
            p.grad = g
        self.reduce_dtype = self.options.reduce_dtype_for(spec)
        self.scaler = LossScaler.for_spec(spec, self.options)
        self.optimizer = ShardedOptimizer([self.params], spec=spec, comm=self.comm, scaler=self.scaler)

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self.grads.zero_()
        n = len(micro_batches)
        loss = accumulate(micro_batches, lambda batch, _last: forward_backward(
            self.model, batch, spec=self.spec, scaler=self.scaler, n=n))
        if self.optimizer.step([self._reduce_scatter_grads()]):
            self.params.all_gather()
        return loss

    def _reduce_scatter_grads(self) -> torch.Tensor:
        """This rank's slice of the group-mean gradient: in place in the buffer, or an fp32 copy when up-casting.

        Note: in place, the buffer is divided by the world size before the sum, as DDP does, so
        that the rounding (and hence training, bit for bit at world 2) matches DDP's.
        """
        world = self.comm.world
        mine = self.grads[self.params.layout.shard_slice(self.comm.rank)]
        if world == 1:
            return mine
        if self.grads.dtype == self.reduce_dtype:
            self.comm.reduce_scatter(mine, self.grads.div_(world))
            return mine
        mine = torch.empty_like(mine, dtype=self.reduce_dtype)
        self.comm.reduce_scatter_upcast(mine, self.grads)
        return mine.div_(world)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return gather_full_parameters([self.params], comm=self.comm, order=self.names)

    def state_bytes(self) -> dict[str, dict[str, int]]:
        return zero_state_bytes(parameters=self.model.parameters(), gradients=[self.grads],
                                optimizer=self.optimizer, device=self.spec.device)

    def metrics(self) -> dict[str, float]:
        return {**self.scaler.metrics(), **self.optimizer.metrics()}

    def save(self, path: str | os.PathLike) -> None:
        checkpoint.save(path, self.optimizer.state_dict(), comm=self.comm, stage=self.stage,
                        layouts=[self.params.layout])

    def load(self, path: str | os.PathLike) -> None:
        state = checkpoint.load(path, comm=self.comm, stage=self.stage, layouts=[self.params.layout],
                                device=self.spec.device)
        self.optimizer.load_state_dict(state)
        self.params.all_gather()
