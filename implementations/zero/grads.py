"""Gradients on their way from autograd to this rank's shard, one bucket (flat group) at a time.

Both kinds of bucket take each parameter's gradient from a ``register_post_accumulate_grad_hook``
the moment autograd has produced it, move it into a flat buffer and drop the parameter's own
``.grad``; when a bucket's last gradient has arrived its reduce-scatter starts asynchronously, so
communication overlaps the rest of backward.

- ``AccumulatedGradBucket`` (stage 1): the buffer is whole and persistent; micro-batches
  accumulate into it and it is reduce-scattered once per step, in place, during the last backward.
- ``GradBucket`` (stages 2 and 3): the buffer lives for one micro-batch only; every micro-batch is
  reduce-scattered into a persistent gradient shard, so no whole gradient outlives its bucket.

Note: gradients are divided by the world size before the sum, as DDP does, so that the rounding
(and at world 2 the whole training run, bit for bit) matches DDP's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from implementations.zero.comm import Comm, Handle
from implementations.zero.flat import FlatLayout


def copy_mean_part(view: torch.Tensor, grad: torch.Tensor, world: int) -> None:
    """``view = grad / world``, in one pass when the dtypes agree."""
    if world == 1:
        view.copy_(grad)
    elif grad.dtype == view.dtype:
        torch.div(grad, world, out=view)
    else:  # up-cast first: dividing in bf16/fp16 would round
        view.copy_(grad).div_(world)


class AccumulatedGradBucket:
    """One flat group's whole gradient, accumulated over a step's micro-batches and reduce-scattered once (stage 1).

    On the last micro-batch, once the group's last gradient has arrived, the buffer is reduce-scattered
    in place: this rank's slice of it receives the group mean, which ``finish`` returns. When the
    gradient dtype is not the reduce dtype, a bucket-sized up-cast copy is reduced instead, into an
    fp32 slice.
    """

    def __init__(self, layout: FlatLayout, *, comm: Comm, dtype: torch.dtype, reduce_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layout = layout
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.buffer = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        self._views = layout.views(self.buffer)
        self._mine = self.buffer[layout.shard_slice(comm.rank)]
        self.begin_step(micro_batches=1)

    def begin_step(self, *, micro_batches: int) -> None:
        self._micro_batches = micro_batches
        self._seen = [False] * len(self._views)
        self._last = micro_batches == 1
        self._count = 0
        self._out: torch.Tensor | None = None
        self._work: Handle | None = None

    def begin_last_micro_batch(self) -> None:
        self._last = True

    def hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """The ``register_post_accumulate_grad_hook`` callback for the group's ``index``-th parameter."""
        def on_grad(param: torch.Tensor) -> None:
            self.add(index, param)
        return on_grad

    def add(self, index: int, param: torch.Tensor) -> None:
        view, grad = self._views[index], param.grad
        if self._seen[index]:
            view.add_(grad)
        elif self._divide_on_the_way_in:
            copy_mean_part(view, grad, self.comm.world)
        else:
            view.copy_(grad)
        param.grad = None
        self._seen[index] = True
        if self._last:
            self._count += 1
            if self._count == len(self._views):
                self._launch()

    @property
    def _divide_on_the_way_in(self) -> bool:
        """With a single micro-batch each gradient is divided as it is copied in, saving a pass."""
        return self._micro_batches == 1 and self.buffer.dtype == self.reduce_dtype

    def _launch(self) -> None:
        if self._work is not None:
            return
        for view, seen in zip(self._views, self._seen):
            if not seen:  # no gradient this step: zeros, not last step's values
                view.zero_()
        world = self.comm.world
        if self.buffer.dtype == self.reduce_dtype:
            if not self._divide_on_the_way_in and world > 1:
                self.buffer.div_(world)
            self._out = self._mine
            self._work = self.comm.reduce_scatter(self._mine, self.buffer, async_op=True)
        else:
            upcast = self.buffer.to(self.reduce_dtype).div_(world)
            self._out = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.buffer.device)
            self._work = self.comm.reduce_scatter(self._out, upcast, async_op=True)

    def finish(self) -> torch.Tensor:
        """After the last backward: this rank's slice of the group-mean gradient."""
        self._launch()
        assert self._work is not None and self._out is not None
        self._work.wait()
        out, self._out, self._work = self._out, None, None
        return out


class GradBucket:
    """Collects one flat group's gradients during backward and reduce-scatters them into ``grad_shard``.

    A hook copies each parameter's gradient into a flat buffer the moment autograd has accumulated
    it, and drops the parameter's own ``.grad``; when the group's last gradient arrives the buffer is
    reduce-scattered asynchronously, overlapping the rest of backward, and ``on_launch`` runs (stage 3
    frees the group's gathered parameters there). ``finish`` waits and folds the result into the
    shard, so no full gradient outlives its bucket.

    Note: the shard holds the group mean: each gradient is divided by the world size on its way into
    the buffer; the first micro-batch of a step overwrites the shard, later ones add to it (the loss
    is already divided by the number of micro-batches, as in DDP).
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
        copy_mean_part(self._views[index], param.grad, self.comm.world)
        param.grad = None
        if not self._arrived[index]:
            self._arrived[index] = True
            self._count += 1
        if self._count == len(self._views):
            self._launch()

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
