"""ZeRO stage 2: stage 1 plus gradients sharded, reduce-scattered bucket by bucket during backward."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from zbench.implementations.zero.engine import ReducedEachMicroBatch
from zbench.implementations.zero.grads import GradBucket, InFlight
from zbench.implementations.zero.optim import ShardedOptimizer
from zbench.implementations.zero.precision import LossScaler
from zbench.implementations.zero.state import Held, total, zero_state_bytes
from zbench.protocol import TrainSpec


class ZeRO2Engine(ReducedEachMicroBatch):
    """Parameters whole on every rank, split into buckets; each rank keeps only its slice of each bucket's gradient.

    Each bucket is its own flat, padded group (``ReplicatedParams``) with a ``GradBucket``: as soon
    as autograd has produced all of a bucket's gradients they are reduce-scattered asynchronously
    into this rank's gradient shard while backward goes on, and the full gradients are dropped.
    Every micro-batch is reduced this way (its full gradients are never kept to accumulate). After
    the step, each bucket's updated slices are all-gathered in place. Offloaded, the gradient shard
    is a host partition that each reduction is copied into as soon as it finishes.
    """

    stage = 2

    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        self._begin(model, spec, group)
        reduce_dtype = self.options.reduce_dtype_for(spec)
        self.groups = self._replicated_groups(reduce_dtype)
        self.inflight = InFlight()
        self.buckets = []
        for group_ in self.groups:
            shard = self.placement.grad_shard(group_.layout.shard_numel, dtype=spec.compute_dtype)
            bucket = GradBucket(
                group_.layout,
                comm=self.comm,
                reduce_dtype=reduce_dtype,
                grad_shard=shard,
                device=spec.device,
                inflight=self.inflight,
            )
            bucket.attach(group_.params)
            self.buckets.append(bucket)
        self._watch_usage(self.buckets, [g.params for g in self.groups])
        self.scaler = LossScaler.for_spec(spec, self.options)
        self.optimizer = ShardedOptimizer(self.placement.masters, spec=spec, comm=self.comm, scaler=self.scaler)

    def state_bytes(self) -> dict[str, dict[str, int]]:
        params = list(self.model.parameters())
        gradients = Held(device=[p.grad for p in params]) + total(b.grad_shard.held() for b in self.buckets)
        return zero_state_bytes(parameters=Held(device=params), gradients=gradients, placed=self.placement.held())
