"""Flat, padded buffers: where each parameter of a group lives, and how the group splits over the ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


@dataclass(frozen=True)
class FlatLayout:
    """A group of parameters laid end to end in one flat buffer, padded to split evenly over ``world`` ranks.

    Note: the padding (at most ``world - 1`` elements) sits at the end and is kept at zero, so it
    changes neither gradient norms nor the optimizer (which is elementwise) and any parameter count
    works at any world size. Rank ``r`` owns ``shard_slice(r)``; shard boundaries may cut through a
    parameter, which is fine for the same reason.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    world: int

    @classmethod
    def of(cls, named: NamedParams, *, world: int) -> FlatLayout:
        if not named:
            raise ValueError("a flat group needs at least one parameter")
        offsets, total = [], 0
        for _, p in named:
            offsets.append(total)
            total += p.numel()
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named), tuple(offsets), total, world)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    def shard_slice(self, rank: int) -> slice:
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def shard_segments(self, rank: int) -> list[tuple[int, int, int]]:
        """``(parameter index, start, stop)`` of each parameter's piece within rank ``rank``'s shard, in order
        (offsets into the shard; padding belongs to none)."""
        first, last = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for index, (offset, shape) in enumerate(zip(self.offsets, self.shapes)):
            start, stop = max(offset, first), min(offset + shape.numel(), last)
            if start < stop:
                out.append((index, start - first, stop - first))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shaped view into ``flat`` (a buffer of ``padded_numel`` elements)."""
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def flatten(self, tensors: Sequence[torch.Tensor], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (one per parameter), padding zeroed."""
        flat = torch.empty(self.padded_numel, dtype=dtype, device=device)
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        flat[self.numel :].zero_()
        return flat


def bind(params: Sequence[torch.nn.Parameter], views: Sequence[torch.Tensor]) -> None:
    """Make each parameter a view of a flat buffer; the model keeps its own ``Parameter`` objects and names."""
    for p, v in zip(params, views):
        p.data = v


def partition_by_numel(named: NamedParams, max_numel: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of at most ``max_numel`` elements (a bigger parameter gets a group of its own).

    Groups are formed in the reverse order of registration, roughly the order in which backward
    produces gradients, so the first group fills first.
    """
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    current: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in reversed(list(named)):
        if current and size + p.numel() > max_numel:
            groups.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        groups.append(current)
    return groups
