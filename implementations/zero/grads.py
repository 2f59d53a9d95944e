"""Gradients on their way from autograd to this rank's gradient shard, one bucket at a time (stages 2 and 3)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from implementations.zero.comm import Comm, Handle
from implementations.zero.flat import FlatLayout


class GradBucket:
    """Collects one flat group's gradients during backward and reduce-scatters them into ``grad_shard``.

    A hook copies each parameter's gradient into a flat buffer the moment autograd has accumulated
    it, and drops the parameter's own ``.grad``; when the group's last gradient arrives the buffer is
    reduce-scattered asynchronously, overlapping the rest of backward, and ``on_launch`` runs (stage 3
    frees the group's gathered parameters there). ``finish`` waits and folds the result into the
    shard, so no full gradient outlives its bucket.

    Note: the shard holds the group mean: each gradient is divided by the world size on its way into
    the buffer (before the sum, like DDP, so that the rounding matches DDP's); the first micro-batch
    of a step overwrites the shard, later ones add to it (the loss is already divided by the number
    of micro-batches, as in DDP).
    """

    def __init__(self, layout: FlatLayout, *, comm: Comm, reduce_dtype: torch.dtype, grad_shard: torch.Tensor,
                 on_launch: Callable[[], None] | None = None) -> None:
        self.layout = layout
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.grad_shard = grad_shard
        self._on_launch = on_launch
        self._fresh = True
        self._reset()

    def _reset(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._arrived = [False] * len(self.layout.names)
        self._count = 0
        self._out: torch.Tensor | None = None
        self._work: Handle | None = None

    def begin_step(self) -> None:
        self._fresh = True

    def hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """The ``register_post_accumulate_grad_hook`` callback for the group's ``index``-th parameter."""
        def on_grad(param: torch.Tensor) -> None:
            self.add(index, param)
        return on_grad

    def add(self, index: int, param: torch.Tensor) -> None:
        if self._buffer is None:
            self._allocate()
        self._copy_mean_part(self._views[index], param.grad)
        param.grad = None
        if not self._arrived[index]:
            self._arrived[index] = True
            self._count += 1
        if self._count == len(self._views):
            self._launch()

    def _copy_mean_part(self, view: torch.Tensor, grad: torch.Tensor) -> None:
        """``view = grad / world``: divided before the sum, as DDP does, so the rounding matches DDP's."""
        world = self.comm.world
        if world == 1:
            view.copy_(grad)
        elif grad.dtype == view.dtype:
            torch.div(grad, world, out=view)
        else:  # up-cast first: dividing in bf16/fp16 would round
            view.copy_(grad).div_(world)

    def _allocate(self) -> None:
        self._buffer = torch.empty(self.layout.padded_numel, dtype=self.reduce_dtype, device=self.grad_shard.device)
        self._buffer[self.layout.numel:].zero_()
        self._views = self.layout.views(self._buffer)

    def _launch(self) -> None:
        if self._work is not None:
            return
        if self._buffer is None:
            self._allocate()
        for view, arrived in zip(self._views, self._arrived):
            if not arrived:  # a parameter that got no gradient this micro-batch contributes zeros
                view.zero_()
        direct = self._fresh and self.grad_shard.dtype == self.reduce_dtype
        self._out = self.grad_shard if direct else torch.empty_like(self.grad_shard, dtype=self.reduce_dtype)
        self._work = self.comm.reduce_scatter(self._out, self._buffer, async_op=True)
        if self._on_launch is not None:
            self._on_launch()

    def finish(self) -> None:
        """After a micro-batch's backward: wait for the reduction and fold it into the shard.

        A bucket whose gradients never all arrived is reduced here (missing ones as zeros), so every
        rank issues the same collectives in the same order.
        """
        self._launch()
        assert self._work is not None and self._out is not None
        self._work.wait()
        out = self._out
        if out is not self.grad_shard:
            if self._fresh:
                self.grad_shard.copy_(out)
            else:
                self.grad_shard.add_(out)
        self._fresh = False
        self._reset()
