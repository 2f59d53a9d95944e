"""Where this rank's shards live between uses: the two small interfaces every offload mode implements.

- ``ParamTier``: this rank's compute-dtype parameter shard. On the device it is simply kept there
  (``DeviceShard``); offloaded (``offload.HostShard``, ``nvme.DiskShard``), stage 3 *fetches* it to
  the device ahead of its all-gather and drops the device copy after. The optimizer writes updated
  values into it with ``update``, wherever it is.
- ``GradShard``: where the optimizer finds this rank's reduced gradient. A gradient bucket
  reduce-scatters into a device tensor and *folds* the result in; the device kinds keep it there
  (``DeviceGradShard``, ``ReducedSlice``), the offloaded kind copies it to the host
  (``offload.HostGradShard``).

Which kinds an engine gets is decided in one place, ``placement``; the stage engines only call
these methods.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zbench.implementations.zero.state import Held
from zbench.state_bytes import same_memory


class ParamTier(Protocol):
    location: str
    """``device``, ``host`` or ``disk``."""

    def update(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Write updated fp32 ``values`` (from the master, wherever it lives) into shard elements ``[lo, hi)``."""

    def fetch(self) -> None:
        """Start bringing the shard to the compute device (no collective: ranks may run ahead of each other)."""

    def take(self) -> torch.Tensor:
        """The shard on the compute device, ready to be all-gathered (fetched now if it was not)."""

    def drop(self) -> None:
        """Forget a fetched copy that was not taken."""

    def held(self) -> Held: ...


class DeviceShard:
    """The shard stays on the compute device (stages 1-2 always; stage 3 unless parameters are offloaded)."""

    location = "device"

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def update(self, lo: int, hi: int, values: torch.Tensor) -> None:
        dst = self.tensor[lo:hi]
        if values.dtype == dst.dtype and same_memory(values, dst):
            return  # an fp32 master on the device *is* the shard
        if values.device != dst.device:
            # Note: copy fp32 to the device, then cast there; a cross-device copy_ with a cast would
            # cast on the host into pageable memory first, which cannot overlap.
            values = values.to(dst.device, non_blocking=True)
        dst.copy_(values)

    def fetch(self) -> None:
        return None

    def take(self) -> torch.Tensor:
        return self.tensor

    def drop(self) -> None:
        return None

    def held(self) -> Held:
        return Held(device=[self.tensor])


class GradShard(Protocol):
    def direct_out(self, *, fresh: bool, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor the reduce-scatter may write into directly, or ``None`` for a transient one to be folded in."""

    def fold(self, out: torch.Tensor, *, fresh: bool) -> None:
        """Take one reduced micro-batch: the first of a step (``fresh``) replaces, later ones add."""

    def ready(self) -> torch.Tensor:
        """The step's gradient shard, once every fold has landed (waits for copies in flight)."""

    def held(self) -> Held: ...


class DeviceGradShard:
    """A persistent gradient shard on the device, in the compute dtype (stages 2 and 3 without offload)."""

    def __init__(self, numel: int, *, dtype: torch.dtype, device: torch.device) -> None:
        self.tensor = torch.zeros(numel, dtype=dtype, device=device)

    def direct_out(self, *, fresh: bool, dtype: torch.dtype) -> torch.Tensor | None:
        return self.tensor if fresh and self.tensor.dtype == dtype else None

    def fold(self, out: torch.Tensor, *, fresh: bool) -> None:
        if out is self.tensor:
            return
        if fresh:
            self.tensor.copy_(out)
        else:
            self.tensor.add_(out)

    def ready(self) -> torch.Tensor:
        return self.tensor

    def held(self) -> Held:
        return Held(device=[self.tensor])


class ReducedSlice:
    """Stage 1 without offload: the optimizer reads its slice of the reduced bucket itself, nothing is kept apart."""

    def __init__(self) -> None:
        self._slice: torch.Tensor | None = None

    def direct_out(self, *, fresh: bool, dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def fold(self, out: torch.Tensor, *, fresh: bool) -> None:
        self._slice = out

    def ready(self) -> torch.Tensor:
        assert self._slice is not None, "no gradient was reduced this step"
        out, self._slice = self._slice, None
        return out

    def held(self) -> Held:
        return Held()  # the slice is part of the stage's bucket buffer, which the stage counts
