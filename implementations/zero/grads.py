"""Gradients on their way from autograd to this rank's shard, one bucket (flat group) at a time.

Both kinds of bucket take each parameter's gradient from a ``register_post_accumulate_grad_hook``
the moment autograd has produced it, move it into a flat buffer and drop the parameter's own
``.grad``; when a bucket's last gradient has arrived its reduce-scatter starts asynchronously, so
communication overlaps the rest of backward.

- ``AccumulatedGradBucket`` (stage 1): the buffer is whole and persistent; micro-batches
  accumulate into it and it is reduce-scattered once per step, in place, during the last backward.
- ``GradBucket`` (stages 2 and 3): the buffer lives for one micro-batch only; every micro-batch is
  reduce-scattered and folded into a persistent gradient shard (``tiers.GradShard``: on the device,
  or copied out to the host as soon as the reduction finishes when the optimizer is offloaded),
  so no whole gradient outlives its bucket.

Note: gradients are divided by the world size before the sum, as DDP does, so that the rounding
(and at world 2 the whole training run, bit for bit) matches DDP's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from zbench.implementations.zero.comm import Comm, Handle
from zbench.implementations.zero.flat import FlatLayout
from zbench.implementations.zero.tiers import GradShard


def copy_mean_part(view: torch.Tensor, grad: torch.Tensor, world: int) -> None:
    """``view = grad / world``, in one pass when the dtypes agree."""
    if world == 1:
        view.copy_(grad)
    elif grad.dtype == view.dtype:
        torch.div(grad, world, out=view)
    else:  # up-cast first: dividing in bf16/fp16 would round
        view.copy_(grad).div_(world)


class _FedByAutograd:
    """A bucket that autograd fills: each parameter's post-accumulate-grad hook hands it to the bucket's ``add``."""

    order: LaunchOrder | None = None
    """Set when the model may leave parameters without a gradient: the buckets then reduce in a fixed order."""
    _marked: set[int]

    def _launch(self) -> None:
        raise NotImplementedError

    def _complete(self) -> None:
        """Every gradient of the group is in, or marked unused: reduce now, or in turn when an order is set."""
        if self.order is None:
            self._launch()
        else:
            self.order.ready(self)

    def _refuse_if_marked(self, index: int) -> None:
        """A gradient for a parameter the graph was found not to reach (a reentrant checkpoint, which runs its
        forward without a graph, hides what it uses): the bucket may already be reduced without it."""
        if index in self._marked:
            raise RuntimeError(
                f"zero: parameter {index} of a bucket got a gradient after the graph was found not to reach it "
                "(a reentrant torch.utils.checkpoint hides the parameters it uses); use use_reentrant=False"
            )

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        """Register the hooks on the group's parameters, in layout order."""
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(self._hook(index))

    def add(self, index: int, param: torch.Tensor) -> None:
        """Take ``param``'s freshly accumulated gradient (the ``index``-th of the group) and drop its ``.grad``."""
        raise NotImplementedError

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            self.add(index, param)

        return on_grad


class LaunchOrder:
    """The buckets' reductions started strictly in one order, as DDP starts its buckets.

    Note: for a model whose parameters may get no gradient (``unused``). A bucket whose parameters are all unused
    on one rank is complete before that rank's backward starts, and midway on another; each starting it when
    complete would put the ranks' reduce-scatters in different orders (a collective mismatch). Started in a fixed
    order (the order the buckets usually fill in), every rank issues the same sequence.
    """

    def __init__(self, buckets: Sequence[_FedByAutograd]) -> None:
        self.buckets = list(buckets)
        self._index = {id(bucket): i for i, bucket in enumerate(self.buckets)}
        for bucket in self.buckets:
            bucket.order = self
        self.restart()

    def restart(self) -> None:
        """Before a backward whose buckets reduce (each micro-batch at stages 2-3, the last at stage 1)."""
        self._ready = [False] * len(self.buckets)
        self._next = 0

    def ready(self, bucket: _FedByAutograd) -> None:
        self._ready[self._index[id(bucket)]] = True
        while self._next < len(self.buckets) and self._ready[self._next]:
            self.buckets[self._next]._launch()
            self._next += 1


class AccumulatedGradBucket(_FedByAutograd):
    """One flat group's whole gradient, accumulated over a step's micro-batches and reduce-scattered once (stage 1).

    On the last micro-batch, once the group's last gradient has arrived, the buffer is reduce-scattered
    in place: this rank's slice of it receives the group mean, which ``finish`` returns. When the
    gradient dtype is not the reduce dtype, a bucket-sized up-cast copy is reduced instead, into an
    fp32 slice.
    """

    def __init__(
        self, layout: FlatLayout, *, comm: Comm, dtype: torch.dtype, reduce_dtype: torch.dtype, device: torch.device
    ) -> None:
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
        self._marked = set()
        self._out: torch.Tensor | None = None
        self._work: Handle | None = None

    def begin_last_micro_batch(self) -> None:
        self._last = True

    def mark_unused(self, index: int) -> None:
        """The ``index``-th parameter gets no gradient in this backward (``unused.Usage``): on the last micro-batch
        the bucket launches once the others have arrived, as on the ranks that do use it."""
        if self._last:
            self._marked.add(index)
            self._count += 1
            if self._count == len(self._views):
                self._complete()

    def used_this_step(self) -> list[bool]:
        return list(self._seen)

    def add(self, index: int, param: torch.Tensor) -> None:
        self._refuse_if_marked(index)
        view, grad = self._views[index], param.grad
        assert grad is not None  # the hook runs once the gradient is accumulated
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
                self._complete()

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
            # scratch: the rest of the buffer is not read again before the next step overwrites it
            self._work = self.comm.reduce_scatter(self._mine, self.buffer, async_op=True, scratch=True)
        else:
            upcast = self.buffer.to(self.reduce_dtype).div_(world)
            self._out = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.buffer.device)
            self._work = self.comm.reduce_scatter(self._out, upcast, async_op=True, scratch=True)

    def finish(self) -> torch.Tensor:
        """After the last backward: this rank's slice of the group-mean gradient."""
        self._launch()
        assert self._work is not None and self._out is not None
        self._work.wait()
        out, self._out, self._work = self._out, None, None
        return out


class InFlight:
    """Reductions started but not yet folded into their shards, oldest first (stages 2 and 3).

    Note: folding a bucket in frees its buffer. Whenever a reduction starts, those already complete
    are folded in, and the oldest is waited for while more than ``limit`` are pending, so only a
    few bucket buffers exist at any time during backward, never the whole gradient.
    """

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self._pending: deque[GradBucket] = deque()

    def started(self, bucket: GradBucket) -> None:
        self._pending.append(bucket)
        while self._pending and (len(self._pending) > self.limit or self._pending[0].reduced):
            self._pending.popleft().finish()

    def clear(self) -> None:
        self._pending.clear()


class GradBucket(_FedByAutograd):
    """Collects one flat group's gradients during backward and reduce-scatters them into ``grad_shard``.

    ``grad_shard`` is a ``tiers.GradShard``: the reduction writes into it directly when it can
    (first micro-batch, same dtype, on the device) and into a transient buffer folded into it
    otherwise (later micro-batches add; an offloaded shard copies the result to the host).

    A hook copies each parameter's gradient (divided by the world size) into a flat buffer the moment
    autograd has accumulated it, and drops the parameter's own ``.grad``; when the group's last
    gradient arrives the buffer is reduce-scattered asynchronously, overlapping the rest of
    backward, and ``on_launch`` runs (stage 3 frees the group's gathered parameters there).
    ``finish`` folds the result into the shard and frees the buffer, as soon as ``InFlight`` finds
    the reduction done.

    Note: the shard holds the group mean: the first micro-batch of a step overwrites it, later ones
    add to it (the loss is already divided by the number of micro-batches, as in DDP).
    """

    def __init__(
        self,
        layout: FlatLayout,
        *,
        comm: Comm,
        reduce_dtype: torch.dtype,
        grad_shard: GradShard,
        device: torch.device,
        inflight: InFlight,
        on_launch: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.grad_shard = grad_shard
        self.device = device
        self._inflight = inflight
        self._on_launch = on_launch
        self._fresh = True
        self._finished = False
        self._used = [False] * len(layout.names)
        self._reset()

    def _reset(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._arrived = [False] * len(self.layout.names)
        self._count = 0
        self._marked = set()
        self._out: torch.Tensor | None = None
        self._work: Handle | None = None

    def begin_step(self) -> None:
        self._fresh = True
        self._used = [False] * len(self.layout.names)

    def mark_unused(self, index: int) -> None:
        """The ``index``-th parameter gets no gradient in this backward (``unused.Usage``): the bucket launches once
        the others have arrived, as on the ranks that do use it, and this one contributes zeros."""
        self._marked.add(index)
        self._count += 1
        if self._count == len(self.layout.names):
            self._complete()

    def used_this_step(self) -> list[bool]:
        return list(self._used)

    def add(self, index: int, param: torch.Tensor) -> None:
        self._refuse_if_marked(index)
        self._used[index] = True
        if self._buffer is None:
            self._allocate()
        assert param.grad is not None  # the hook runs once the gradient is accumulated
        copy_mean_part(self._views[index], param.grad, self.comm.world)
        param.grad = None
        if not self._arrived[index]:
            self._arrived[index] = True
            self._count += 1
        if self._count == len(self._views):
            self._complete()

    def _allocate(self) -> None:
        self._buffer = torch.empty(self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device)
        self._buffer[self.layout.numel :].zero_()
        self._views = self.layout.views(self._buffer)

    def _launch(self) -> None:
        if self._work is not None:
            return
        if self._buffer is None:
            self._allocate()
        assert self._buffer is not None
        for view, arrived in zip(self._views, self._arrived):
            if not arrived:  # a parameter that got no gradient this micro-batch contributes zeros
                view.zero_()
        direct = self.grad_shard.direct_out(fresh=self._fresh, dtype=self.reduce_dtype)
        self._out = (
            direct
            if direct is not None
            else torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
        )
        self._work = self.comm.reduce_scatter(self._out, self._buffer, async_op=True, scratch=True)
        if self._on_launch is not None:
            self._on_launch()
        self._inflight.started(self)

    @property
    def reduced(self) -> bool:
        """Whether the reduction has completed (folding it in will not block)."""
        return self._work is not None and self._work.is_completed()

    def finish(self) -> None:
        """Wait for the reduction, fold it into the shard and free the buffer; a no-op when none is pending."""
        if self._work is None:
            return
        self._work.wait()
        assert self._out is not None  # set with self._work
        self.grad_shard.fold(self._out, fresh=self._fresh)
        self._fresh = False
        self._finished = True
        self._reset()

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward: make sure this bucket was reduced and folded in.

        A bucket whose gradients never all arrived is reduced here (missing ones as zeros), so every
        rank issues the same collectives in the same order.
        """
        if not self._finished:
            self._launch()
            self.finish()
        self._finished = False
