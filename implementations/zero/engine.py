"""What every stage's engine answers the same way: full parameters, metrics, sharded checkpoints, closing."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from zbench.implementations._common import accumulate, may_leave_unused
from zbench.implementations.zero import checkpoint
from zbench.implementations.zero.comm import Comm, Handle
from zbench.implementations.zero.flat import partition_by_numel
from zbench.implementations.zero.grads import AccumulatedGradBucket, GradBucket, InFlight, LaunchOrder
from zbench.implementations.zero.loop import forward_backward
from zbench.implementations.zero.optim import ShardedOptimizer
from zbench.implementations.zero.options import ZeroOptions
from zbench.implementations.zero.params import ReplicatedParams, ShardedParams
from zbench.implementations.zero.placement import Placement
from zbench.implementations.zero.precision import LossScaler
from zbench.implementations.zero.state import gather_full_parameters
from zbench.implementations.zero.unused import Usage
from zbench.protocol import MicroBatch, TrainSpec

GATHERS_IN_FLIGHT = 2


class ShardedEngine:
    """Shared tail of ``ZeRO1Engine``, ``ZeRO2Engine`` and ``ZeRO3Engine``.

    A subclass sets ``stage``, ``spec``, ``comm``, ``names``, ``placement``, ``optimizer`` and
    ``scaler`` and says which flat parameter groups it holds (``flat_groups``).
    """

    stage: int
    groups: list[ReplicatedParams]
    optimizer: ShardedOptimizer
    scaler: LossScaler
    usage: Usage | None = None
    """Set when the model may leave parameters without a gradient (``unused``)."""
    launch_order: LaunchOrder | None = None
    """Set with ``usage`` at stages 1 and 2; restarted before each backward whose buckets reduce."""

    def _begin(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        """What every stage sets up first: options, communicator, parameter names and the offload placement."""
        self.model, self.spec = model, spec
        self.options = ZeroOptions.from_spec(spec)
        self.comm = Comm(group)
        self.names = [name for name, _ in model.named_parameters()]
        self.placement = Placement(
            spec, self.options, self.comm, stage=self.stage, per_parameter=may_leave_unused(model)
        )

    def _watch_usage(
        self, buckets: Sequence[AccumulatedGradBucket] | Sequence[GradBucket], params: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        """When the model may leave parameters without a gradient: track them (``unused.Usage``) and, at stages 1
        and 2, reduce the buckets in a fixed order (``grads.LaunchOrder``)."""
        if not may_leave_unused(self.model):
            return
        self.usage = Usage(
            buckets, params, comm=self.comm, device=self.spec.device, whole_bucket_may_idle=self.stage < 3
        )
        if self.stage < 3:
            self.launch_order = LaunchOrder(buckets)

    def _micro_batch(self, batch: MicroBatch, n: int) -> torch.Tensor:
        """One micro-batch's forward and backward (of ``n`` in the step), with parameters the graph does not reach
        marked in between when the model may leave some unused."""
        hook = self.usage.before_backward if self.usage else None
        return forward_backward(self.model, batch, spec=self.spec, scaler=self.scaler, n=n, before_backward=hook)

    def _skipped(self) -> list[set[int]] | None:
        """After the step's backward: per bucket, the parameters no rank used (``None``: the model has none)."""
        return self.usage.skipped() if self.usage is not None else None

    def _replicated_groups(self, reduce_dtype: torch.dtype) -> list[ReplicatedParams]:
        """Stages 1 and 2: the model's parameters in bucket-sized flat groups, each group's master shard handed
        to the placement's master store."""
        groups = []
        for chunk in partition_by_numel(list(self.model.named_parameters()), self.options.bucket_numel(reduce_dtype)):
            group = ReplicatedParams(chunk, comm=self.comm, dtype=self.spec.compute_dtype)
            self.placement.masters.add(group.take_master(), group.tier, group.layout.shard_segments(self.comm.rank))
            groups.append(group)
        return groups

    def flat_groups(self) -> Sequence[ReplicatedParams | ShardedParams]:
        return self.groups

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return gather_full_parameters(
            [g.layout for g in self.flat_groups()],
            self.optimizer.masters.masters(),
            comm=self.comm,
            order=self.names,
            device=self.spec.device,
        )

    def metrics(self) -> dict[str, float]:
        return {**self.scaler.metrics(), **self.optimizer.metrics()}

    def save(self, path: str | os.PathLike) -> None:
        """A sharded checkpoint; offloaded state is read back (from the host or from disk) into it."""
        checkpoint.save(
            path,
            self.optimizer.state_dict(),
            comm=self.comm,
            stage=self.stage,
            layouts=[g.layout for g in self.flat_groups()],
        )

    def load(self, path: str | os.PathLike) -> None:
        """Resume from ``save``'s checkpoint under any offload mode; state goes where this engine keeps it."""
        state = checkpoint.load(
            path,
            comm=self.comm,
            stage=self.stage,
            layouts=[g.layout for g in self.flat_groups()],
            device=self.optimizer.masters.home,
        )
        self.optimizer.load_state_dict(state)
        self.refresh_parameters()

    def refresh_parameters(self) -> None:
        """Stages 1 and 2 hold full parameters: all-gather them from the updated shards (after a step or a load).

        Note: at most ``GATHERS_IN_FLIGHT`` gathers are outstanding. gloo allocates an all-gather's
        receive buffer when the collective is enqueued, so starting every group's gather at once
        held a second, transient copy of the whole model (and left it resident as heap
        fragmentation); gloo runs two collectives at a time anyway, and on NCCL ``wait`` does not
        block the host, so nothing is lost.
        """
        inflight: deque[Handle] = deque()
        for group in self.groups:
            inflight.append(group.all_gather(async_op=True))
            if len(inflight) > GATHERS_IN_FLIGHT:
                inflight.popleft().wait()
        while inflight:
            inflight.popleft().wait()

    def buffer_bytes(self) -> dict[str, int]:
        """The NVMe tier's host buffers (``NvmeMasters.buffer_bytes``); none for the other offload modes."""
        return self.placement.buffer_bytes()

    def close(self) -> None:
        """Release what outlives the engine's tensors: with ``nvme``, finish I/O and remove this rank's swap files.

        Idempotent; the engine must not be used afterwards. A no-op for the other offload modes.
        """
        self.placement.close()


class ReducedEachMicroBatch(ShardedEngine):
    """The step of stages 2 and 3, whose ``GradBucket``s reduce-scatter every micro-batch as backward runs.

    A subclass sets ``buckets`` and ``inflight``; ``after_micro_batch`` is where stage 3 frees the
    gathered parameters that backward left behind.
    """

    buckets: list[GradBucket]
    inflight: InFlight

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        for bucket in self.buckets:
            bucket.begin_step()
        loss = accumulate(micro_batches, lambda batch, _last: self._forward_backward(batch, len(micro_batches)))
        if self.optimizer.step([bucket.grad_shard.ready() for bucket in self.buckets], skip=self._skipped()):
            self.refresh_parameters()
        return loss

    def _forward_backward(self, batch: MicroBatch, n: int) -> torch.Tensor:
        if self.launch_order is not None:
            self.launch_order.restart()
        loss = self._micro_batch(batch, n)
        for bucket in self.buckets:
            bucket.end_micro_batch()
        self.inflight.clear()
        self.after_micro_batch()
        return loss

    def after_micro_batch(self) -> None:
        """Nothing by default."""
