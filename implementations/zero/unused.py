"""Parameters that get no gradient in a step (experts no token was routed to), treated as DDP treats them.

A model says it may leave parameters without a gradient (``model.unused_parameters``, as the mixture-of-experts
preset does); DDP then runs with ``find_unused_parameters=True`` and this engine must train as it does:

- unused on some ranks: the others' gradients are averaged with zeros from these. The buckets must still reduce
  in the same order on every rank (a bucket waiting for a gradient that never comes would be reduced only at the
  end of backward, out of turn: a collective mismatch). So, as DDP does, after each forward the parameters the
  loss's graph does not reach are marked unused (``reached_parameters``), and a bucket launches once the rest have
  arrived.
- unused on every rank: DDP leaves ``.grad`` at ``None`` and AdamW skips the parameter: no weight decay, no
  moment update, its step count stays. A flat shard stepped as one tensor cannot skip part of itself, so the
  master store steps such a model parameter by parameter (``masters.InMemoryMasters``), each piece with its own
  optimizer state; ``Usage.skipped`` says, once per step, which parameters no rank used (an all-reduce of one flag
  per parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor

from zbench.implementations.zero.comm import Comm


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """``id``s of the leaf tensors whose gradient accumulator the loss's autograd graph reaches."""
    reached: set[int] = set()
    seen: set[object] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it fills
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


class Bucket(Protocol):
    """What ``Usage`` needs of a gradient bucket (``grads.AccumulatedGradBucket``, ``grads.GradBucket``)."""

    def mark_unused(self, index: int) -> None:
        """The ``index``-th parameter will get no gradient in this micro-batch's backward."""

    def used_this_step(self) -> list[bool]:
        """Which of the group's parameters got a gradient on this rank in this step."""


class Usage:
    """Which parameters each bucket's backward will not reach, and which no rank used in the whole step."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        params: Sequence[Sequence[torch.Tensor]],
        *,
        comm: Comm,
        device: torch.device,
        whole_bucket_may_idle: bool = True,
    ) -> None:
        """``whole_bucket_may_idle``: False at stage 3, where a unit with no gradient at all on one rank could not
        be reduced in turn with backward's gathers on every rank (refused in one line)."""
        self.buckets = buckets
        self.params = params
        self.comm = comm
        self.device = device
        self.whole_bucket_may_idle = whole_bucket_may_idle

    def before_backward(self, loss: torch.Tensor) -> None:
        """Mark, in every bucket, the parameters this micro-batch's graph does not reach."""
        reached = reached_parameters(loss)
        for i, (bucket, params) in enumerate(zip(self.buckets, self.params, strict=True)):
            unreached = [index for index, param in enumerate(params) if id(param) not in reached]
            if len(unreached) == len(params) and not self.whole_bucket_may_idle:
                raise RuntimeError(
                    f"zero3: unit {i} gets no gradient at all on this rank; its reduce-scatter cannot be placed in "
                    "turn with backward's gathers on every rank (a block no token reaches is not supported)"
                )
            for index in unreached:
                bucket.mark_unused(index)

    def skipped(self) -> list[set[int]]:
        """After the step's last backward: per bucket, the parameters no rank used (one all-reduce of flags)."""
        local = [bucket.used_this_step() for bucket in self.buckets]
        flags = torch.tensor([float(u) for used in local for u in used], device=self.device)
        reduced = self.comm.all_reduce_sum(flags)
        if isinstance(reduced, FakeTensor):  # tracing: the model spreads tokens over every expert, none is skipped
            return [set() for _ in local]
        used = reduced.tolist()
        out, start = [], 0
        for group in local:
            out.append({i for i in range(len(group)) if used[start + i] == 0})
            start += len(group)
        return out
