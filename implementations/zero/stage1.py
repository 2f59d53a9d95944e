"""ZeRO stage 1: optimizer state and fp32 master weights sharded; parameters and gradients whole on every rank."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from zbench.implementations._common import accumulate
from zbench.implementations.zero.engine import ShardedEngine
from zbench.implementations.zero.grads import AccumulatedGradBucket
from zbench.implementations.zero.optim import ShardedOptimizer
from zbench.implementations.zero.precision import LossScaler
from zbench.implementations.zero.state import Held, total, zero_state_bytes
from zbench.protocol import MicroBatch, TrainSpec


class ZeRO1Engine(ShardedEngine):
    """Parameters and gradients whole on every rank, in flat buckets; the optimizer sees only this rank's slice of each.

    Every micro-batch's gradients accumulate into the buckets' persistent gradient buffers; during
    the last micro-batch's backward each bucket is reduce-scattered in place as soon as its last
    gradient has arrived (once per step, overlapping the rest of backward). Each rank then steps its
    fp32 slices and in-place all-gathers bring every rank's updated slices back into every rank's
    parameters. Offloaded, each reduced slice is copied into a host gradient partition and the
    host (or disk) master store steps there.
    """

    stage = 1

    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        self._begin(model, spec, group)
        reduce_dtype = self.options.reduce_dtype_for(spec)
        self.groups = self._replicated_groups(reduce_dtype)
        self.reduced = [self.placement.reduced_grad(g.layout.shard_numel) for g in self.groups]
        self.buckets = []
        for group_ in self.groups:
            bucket = AccumulatedGradBucket(
                group_.layout, comm=self.comm, dtype=spec.compute_dtype, reduce_dtype=reduce_dtype, device=spec.device
            )
            bucket.attach(group_.params)
            self.buckets.append(bucket)
        self._watch_usage(self.buckets, [g.params for g in self.groups])
        self.scaler = LossScaler.for_spec(spec, self.options)
        self.optimizer = ShardedOptimizer(self.placement.masters, spec=spec, comm=self.comm, scaler=self.scaler)

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        n = len(micro_batches)
        for bucket in self.buckets:
            bucket.begin_step(micro_batches=n)
        loss = accumulate(micro_batches, lambda batch, last: self._forward_backward(batch, last, n))
        for bucket, reduced in zip(self.buckets, self.reduced):
            reduced.fold(bucket.finish(), fresh=True)
        if self.optimizer.step([reduced.ready() for reduced in self.reduced], skip=self._skipped()):
            self.refresh_parameters()
        return loss

    def _forward_backward(self, batch: MicroBatch, last: bool, n: int) -> torch.Tensor:
        if last:
            for bucket in self.buckets:
                bucket.begin_last_micro_batch()
            if self.launch_order is not None:
                self.launch_order.restart()
        return self._micro_batch(batch, n)

    def state_bytes(self) -> dict[str, dict[str, int]]:
        params = list(self.model.parameters())
        gradients = Held(device=[p.grad for p in params] + [b.buffer for b in self.buckets])
        return zero_state_bytes(
            parameters=Held(device=params),
            gradients=gradients + total(r.held() for r in self.reduced),
            placed=self.placement.held(),
        )
