"""ZeRO stage 3: parameters sharded too; each block gathered just before its forward and its backward, then freed."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from zbench.implementations.zero.engine import ReducedEachMicroBatch
from zbench.implementations.zero.grads import GradBucket, InFlight
from zbench.implementations.zero.optim import ShardedOptimizer
from zbench.implementations.zero.params import ShardedParams
from zbench.implementations.zero.precision import LossScaler
from zbench.implementations.zero.state import Held, total, zero_state_bytes
from zbench.protocol import TrainSpec, root_held


def split_units(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[list[tuple[str, nn.Parameter]]]]:
    """The root's own parameters and each block's, named as ``model.named_parameters()`` names them.

    Blocks are the entries of ``model.blocks`` when it has one; everything else (embeddings, final
    norm, head) belongs to the root. A model without ``blocks`` is one unit, gathered whole.

    Note: a parameter shared by two blocks (or by a block and the root) belongs to the root: a unit's
    parameters are views of its own flat buffer, freed between its forward and backward, so a weight
    bound into one block's buffer would be freed under the other block's feet. The root stays gathered
    from the model's forward until the end of its backward, so a shared weight is always there; its
    gradient from every use is summed by autograd before the root's bucket takes it.
    """
    name_of = {id(p): name for name, p in model.named_parameters()}
    units = list(getattr(model, "blocks", []))
    owners: dict[int, int] = {}
    for block in units:
        for p in set(map(id, block.parameters())):
            owners[p] = owners.get(p, 0) + 1
    direct = root_held(model, units)
    shared = {p for p, n in owners.items() if n > 1 or p in direct}
    blocks = [[(name_of[id(p)], p) for p in block.parameters() if id(p) not in shared] for block in units]
    in_blocks = {id(p) for block in blocks for _, p in block}
    root = [(name, p) for name, p in model.named_parameters() if id(p) not in in_blocks]
    return root, blocks


def weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method``, called through a weak reference to its object.

    Note: a unit's gradient bucket calls ``unit.reshard`` and the unit's parameters hold the bucket
    (through their hooks); a strong reference would make a cycle only the garbage collector frees.
    """
    ref = weakref.WeakMethod(method)

    def call() -> None:
        target = ref()
        if target is not None:
            target()

    return call


class Schedule:
    """When each unit is gathered and freed, driven by module and tensor hooks.

    - forward: the root is gathered when the model's forward starts and kept until its gradients are
      reduced at the end of backward (FSDP treats its root the same way); each block is gathered in
      its forward pre-hook while the next ``prefetch`` blocks' gathers start, and freed after its
      forward, except the last, whose backward comes next;
    - backward: a hook on each block's output fires before the block's backward: the block is
      gathered (usually already prefetched) and the gathers of the ``prefetch`` blocks before it
      start. Freeing after backward is the gradient bucket's ``on_launch``;
    - offloaded shards (host or disk) are *fetched* one block further ahead than they are gathered:
      the copy to the device (or the read from disk) of the block after the prefetched ones starts
      with those gathers, so it overlaps a block's compute. Fetching is no collective, so it may
      finish at different times on different ranks; the gathers stay in the same order everywhere.

    Note: the hooks hold this object, not the engine, so the model does not keep its engine alive.
    """

    def __init__(self, root: ShardedParams | None, blocks: list[ShardedParams], *, prefetch: int) -> None:
        self.root, self.blocks, self.prefetch = root, blocks, prefetch

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self.before_model_forward)
        for i, block in enumerate(getattr(model, "blocks", [])):
            block.register_forward_pre_hook(partial(self.before_block_forward, i))
            block.register_forward_hook(partial(self.after_block_forward, i))

    def _prefetch(self, indices: range, *, fetch: int) -> None:
        """Start the gathers of blocks ``indices`` and the fetch of block ``fetch`` (when they exist)."""
        for j in indices:
            if 0 <= j < len(self.blocks):
                self.blocks[j].unshard(async_op=True)
        if 0 <= fetch < len(self.blocks):
            self.blocks[fetch].fetch()

    def before_model_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.root is not None:
            self.root.unshard(async_op=True)
        self._prefetch(range(self.prefetch), fetch=self.prefetch)
        if self.root is not None:
            self.root.wait()

    def before_block_forward(self, i: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.blocks[i].unshard()
        self._prefetch(range(i + 1, i + 1 + self.prefetch), fetch=i + 1 + self.prefetch)

    def after_block_forward(self, i: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        backward_follows = torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad
        if backward_follows:
            output.register_hook(partial(self.before_block_backward, i))
            if i == len(self.blocks) - 1:
                return  # the first block backward needs: keep it
        self.blocks[i].reshard()

    def before_block_backward(self, i: int, grad: torch.Tensor) -> None:
        self.blocks[i].unshard()
        self._prefetch(range(i - 1, i - 1 - self.prefetch, -1), fetch=i - 1 - self.prefetch)


class ZeRO3Engine(ReducedEachMicroBatch):
    """Every rank keeps only its slice of each unit's parameters, gradients and optimizer state.

    Units are the root (embeddings, final norm, head) and each transformer block, each a flat,
    padded ``ShardedParams`` with a ``GradBucket``; a ``Schedule`` gathers each unit around its
    forward and backward. Once autograd has produced all of a unit's gradients they are
    reduce-scattered asynchronously and its gathered parameters are freed. Between steps a rank
    holds shards only; the optimizer writes straight into them, so the next forward's gathers see
    the updated parameters. Where the shards live (device, host, disk) is the ``Placement``'s:
    offloaded, each shard is fetched to the device ahead of its gather.
    """

    stage = 3

    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        self._begin(model, spec, group)
        root, blocks = split_units(model)
        empty = [i for i, block in enumerate(blocks) if not block]
        if empty:
            raise ValueError(f"zero3: blocks {empty} have no parameters of their own (all are shared with others)")
        dtype = spec.compute_dtype
        self.units = []
        for named in ([root] if root else []) + blocks:
            unit = ShardedParams(named, comm=self.comm, dtype=dtype, tier=self.placement.param_tier)
            self.placement.masters.add(unit.take_master(), unit.tier, unit.layout.shard_segments(self.comm.rank))
            self.units.append(unit)
        self.root = self.units[0] if root else None
        self.blocks = self.units[1:] if root else self.units
        reduce_dtype = self.options.reduce_dtype_for(spec)
        self.inflight = InFlight()
        self.buckets = []
        for unit in self.units:
            shard = self.placement.grad_shard(unit.layout.shard_numel, dtype=dtype)
            bucket = GradBucket(
                unit.layout,
                comm=self.comm,
                reduce_dtype=reduce_dtype,
                grad_shard=shard,
                device=spec.device,
                inflight=self.inflight,
                on_launch=weakly(unit.reshard),
            )
            bucket.attach(unit.params)
            self.buckets.append(bucket)
        self._watch_usage(self.buckets, [unit.params for unit in self.units])
        Schedule(self.root, self.blocks, prefetch=self.options.prefetch).install(model)
        self.scaler = LossScaler.for_spec(spec, self.options)
        self.optimizer = ShardedOptimizer(self.placement.masters, spec=spec, comm=self.comm, scaler=self.scaler)

    def after_micro_batch(self) -> None:
        for unit in self.units:
            unit.reshard()

    def state_bytes(self) -> dict[str, dict[str, int]]:
        params = list(self.model.parameters())
        parameters = Held(device=params) + total(u.tier.held() for u in self.units)
        gradients = Held(device=[p.grad for p in params]) + total(b.grad_shard.held() for b in self.buckets)
        return zero_state_bytes(parameters=parameters, gradients=gradients, placed=self.placement.held())

    def flat_groups(self) -> Sequence[ShardedParams]:
        return self.units

    def refresh_parameters(self) -> None:
        """Stage 3's parameters are the shards themselves: nothing to gather after a step or a load."""
