"""ZeRO stage 2: stage 1 plus gradients sharded, reduce-scattered bucket by bucket during backward."""

from __future__ import annotations

import torch
from torch import nn

from implementations._common import accumulate
from implementations.zero.comm import Comm
from implementations.zero.flat import partition_by_numel
from implementations.zero.grads import GradBucket, InFlight
from implementations.zero.loop import forward_backward
from implementations.zero.engine import ShardedEngine
from implementations.zero.optim import ShardedOptimizer
from implementations.zero.options import ZeroOptions
from implementations.zero.params import ReplicatedParams
from implementations.zero.placement import Placement
from implementations.zero.precision import LossScaler
from implementations.zero.state import Held, total, zero_state_bytes
from zbench.protocol import MicroBatch, TrainSpec


class ZeRO2Engine(ShardedEngine):
    """Parameters whole on every rank, split into buckets; each rank keeps only its slice of each bucket's gradient.

    Each bucket is its own flat, padded group (``ReplicatedParams``) with a ``GradBucket``: as soon
    as autograd has produced all of a bucket's gradients they are reduce-scattered asynchronously
    into this rank's gradient shard while backward goes on, and the full gradients are dropped.
    Every micro-batch is reduced this way (its full gradients are never kept to accumulate). After
    the step, each bucket's updated slices are all-gathered in place. Offloaded, the gradient shard
    is a host partition that each reduction is copied into as soon as it finishes.
    """

    stage = 2

    def __init__(self, model: nn.Module, spec: TrainSpec, group) -> None:
        self.model, self.spec = model, spec
        self.options = ZeroOptions.from_spec(spec)
        self.comm = Comm(group)
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        reduce_dtype = self.options.reduce_dtype_for(spec)
        self.placement = Placement(spec, self.options, self.comm, stage=self.stage)
        self.groups = []
        for chunk in partition_by_numel(named, self.options.bucket_numel(reduce_dtype)):
            group_ = ReplicatedParams(chunk, comm=self.comm, dtype=spec.compute_dtype)
            self.placement.masters.add(group_.take_master(), group_.tier)
            self.groups.append(group_)
        self.inflight = InFlight()
        self.buckets = []
        for group_ in self.groups:
            shard = self.placement.grad_shard(group_.layout.shard_numel, dtype=spec.compute_dtype)
            bucket = GradBucket(group_.layout, comm=self.comm, reduce_dtype=reduce_dtype, grad_shard=shard,
                                device=spec.device, inflight=self.inflight)
            for i, p in enumerate(group_.params):
                p.register_post_accumulate_grad_hook(bucket.hook(i))
            self.buckets.append(bucket)
        self.scaler = LossScaler.for_spec(spec, self.options)
        self.optimizer = ShardedOptimizer(self.placement.masters, spec=spec, comm=self.comm, scaler=self.scaler)

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        for bucket in self.buckets:
            bucket.begin_step()
        loss = accumulate(micro_batches, lambda batch, _last: self._forward_backward(batch, len(micro_batches)))
        if self.optimizer.step([bucket.grad_shard.ready() for bucket in self.buckets]):
            self.refresh_parameters()
        return loss

    def _forward_backward(self, batch: MicroBatch, n: int) -> torch.Tensor:
        loss = forward_backward(self.model, batch, spec=self.spec, scaler=self.scaler, n=n)
        for bucket in self.buckets:
            bucket.end_micro_batch()
        self.inflight.clear()
        return loss

    def state_bytes(self) -> dict[str, dict[str, int]]:
        params = list(self.model.parameters())
        gradients = Held(device=[p.grad for p in params]) + total(b.grad_shard.held() for b in self.buckets)
        return zero_state_bytes(parameters=Held(device=params), gradients=gradients, placement=self.placement)
