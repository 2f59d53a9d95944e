"""Parameters as flat groups: whole on every rank (stages 1 and 2) or sharded and gathered on demand (stage 3).

Both kinds expose what the sharded optimizer needs: ``shard``, this rank's slice in the compute
dtype, and ``master``, its fp32 master copy, which *is* ``shard`` when training in fp32 (so fp32
keeps no extra copy, as the ZeRO formulas assume).
"""

from __future__ import annotations

import enum

import torch

from implementations.zero.comm import DONE, Comm, Handle
from implementations.zero.flat import FlatLayout, NamedParams, bind


def _master(shard: torch.Tensor, fp32_values: torch.Tensor) -> torch.Tensor:
    """The fp32 master slice: ``shard`` itself in fp32; a separate fp32 copy of the exact initial values otherwise."""
    return shard if shard.dtype == torch.float32 else fp32_values.clone()


class ReplicatedParams:
    """A group of parameters kept whole on every rank as views of one flat, padded buffer (stages 1 and 2).

    This rank owns one slice of the buffer: the optimizer updates it, and ``all_gather`` brings
    every rank's updated slice back into every rank's buffer, in place.
    """

    def __init__(self, named: NamedParams, *, comm: Comm, dtype: torch.dtype) -> None:
        self.comm = comm
        self.params = [p for _, p in named]
        self.layout = FlatLayout.of(named, world=comm.world)
        device = self.params[0].device
        values = self.layout.flatten([p.detach() for p in self.params], dtype=torch.float32, device=device)
        self.flat = values.to(dtype)
        bind(self.params, self.layout.views(self.flat))
        mine = self.layout.shard_slice(comm.rank)
        self.shard = self.flat[mine]
        self.master = _master(self.shard, values[mine])

    def all_gather(self, *, async_op: bool = False) -> Handle:
        return self.comm.all_gather(self.flat, self.shard, async_op=async_op)


class _State(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedParams:
    """One module's parameters kept only as this rank's slice; gathered whole around its forward and backward (stage 3).

    Note: the parameters are views of a full flat buffer whose *storage* is resized to zero bytes
    when freed rather than dropped, so every view of it (the parameters, and whatever autograd saved
    for backward) stays valid and sees the data again after the next gather. FSDP does the same.
    """

    def __init__(self, named: NamedParams, *, comm: Comm, dtype: torch.dtype) -> None:
        self.comm = comm
        self.params = [p for _, p in named]
        self.layout = FlatLayout.of(named, world=comm.world)
        device = self.params[0].device
        values = self.layout.flatten([p.detach() for p in self.params], dtype=torch.float32, device=device)
        mine = self.layout.shard_slice(comm.rank)
        self.shard = values[mine].to(dtype, copy=True)
        self.master = _master(self.shard, values[mine])
        del values
        self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        self._full_nbytes = self.full.untyped_storage().nbytes()
        bind(self.params, self.layout.views(self.full))
        self._state = _State.GATHERED
        self._work: Handle = DONE
        self.reshard()

    @property
    def is_gathered(self) -> bool:
        return self._state is _State.GATHERED

    def unshard(self, *, async_op: bool = False) -> None:
        """Gather the full parameters (start it only, with ``async_op``); a no-op when already gathered."""
        if self._state is _State.SHARDED:
            self.full.untyped_storage().resize_(self._full_nbytes)
            self._work = self.comm.all_gather(self.full, self.shard, async_op=True)
            self._state = _State.GATHERING
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self._state is _State.GATHERING:
            self._work.wait()
            self._work = DONE
            self._state = _State.GATHERED

    def reshard(self) -> None:
        """Free the full parameters (their storage drops to zero bytes); this rank keeps its shard."""
        self.wait()
        if self._state is _State.GATHERED:
            self.full.untyped_storage().resize_(0)
            self._state = _State.SHARDED
