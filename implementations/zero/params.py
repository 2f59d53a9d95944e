"""Parameters as flat groups: whole on every rank (stages 1 and 2) or sharded and gathered on demand (stage 3).

Both kinds expose what the master store needs: ``tier``, where this rank's compute-dtype slice
lives (``tiers.ParamTier``), and ``take_master()``, the exact fp32 initial values of that slice,
handed over once. In fp32 that *is* the device shard, so a store that keeps its masters on the
device keeps no extra copy (as the ZeRO formulas assume); an offloading store copies it away and
the group forgets it, so no full set of masters is ever resident during construction.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from zbench.implementations.zero.comm import DONE, Comm, Handle
from zbench.implementations.zero.flat import FlatLayout, NamedParams, bind
from zbench.implementations.zero.tiers import DeviceShard, ParamTier


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
        self.tier = DeviceShard(self.shard)
        self._master: torch.Tensor | None = _master(self.shard, values[mine])

    def take_master(self) -> torch.Tensor:
        """The fp32 initial values of this rank's slice, for the master store (once)."""
        master, self._master = self._master, None
        assert master is not None, "the master was already taken"
        return master

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

    This rank's shard lives in ``tier`` (``tier(shard)`` decides where: the device, or offloaded to
    the host or to disk); ``fetch`` starts bringing an offloaded shard to the device ahead of the
    gather, which then takes it as its input.
    """

    def __init__(
        self,
        named: NamedParams,
        *,
        comm: Comm,
        dtype: torch.dtype,
        tier: Callable[[torch.Tensor], ParamTier] = DeviceShard,
    ) -> None:
        self.comm = comm
        self.params = [p for _, p in named]
        self.layout = FlatLayout.of(named, world=comm.world)
        device = self.params[0].device
        values = self.layout.flatten([p.detach() for p in self.params], dtype=torch.float32, device=device)
        mine = self.layout.shard_slice(comm.rank)
        shard = values[mine].to(dtype, copy=True)
        self._master: torch.Tensor | None = _master(shard, values[mine])
        self.tier = tier(shard)
        del values, shard
        self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        self._full_nbytes = self.full.untyped_storage().nbytes()
        bind(self.params, self.layout.views(self.full))
        self._state = _State.GATHERED
        self._work: Handle = DONE
        self._input: torch.Tensor | None = None
        self.reshard()

    def take_master(self) -> torch.Tensor:
        """The fp32 initial values of this rank's slice, for the master store (once)."""
        master, self._master = self._master, None
        assert master is not None, "the master was already taken"
        return master

    @property
    def is_gathered(self) -> bool:
        return self._state is _State.GATHERED

    def fetch(self) -> None:
        """Start bringing an offloaded shard to the device (no collective); a no-op when gathered or on the device."""
        if self._state is _State.SHARDED:
            self.tier.fetch()

    def unshard(self, *, async_op: bool = False) -> None:
        """Gather the full parameters (start it only, with ``async_op``); a no-op when already gathered."""
        if self._state is _State.SHARDED:
            self._input = self.tier.take()  # kept until the gather is done
            self.full.untyped_storage().resize_(self._full_nbytes)
            self._work = self.comm.all_gather(self.full, self._input, async_op=True)
            self._state = _State.GATHERING
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self._state is _State.GATHERING:
            self._work.wait()
            self._work = DONE
            self._input = None
            self._state = _State.GATHERED

    def reshard(self) -> None:
        """Free the full parameters (the storage drops to zero bytes) and any unused fetch; the tier keeps the shard."""
        self.wait()
        if self._state is _State.GATHERED:
            self.full.untyped_storage().resize_(0)
            self._state = _State.SHARDED
        self.tier.drop()
