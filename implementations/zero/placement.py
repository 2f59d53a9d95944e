"""Where one engine keeps each part of its model state, from ``TrainSpec.offload``: the only module that reads it.

====================  ======================  =================  ============================
offload               master + optimizer      gradient shard     stage-3 parameter shard
====================  ======================  =================  ============================
``none``              device                  device             device
``optimizer``         host (ZeRO-Offload)     host, fp32         device
``optimizer+params``  host                    host, fp32         host (stage 3 only)
``nvme``              disk (ZeRO-Infinity)    host, fp32         disk (stage 3; 1-2: device)
====================  ======================  =================  ============================

Stage 1 keeps its whole gradient buffers on the device in every mode (it reduces them once per
step); offloaded, each reduced slice is then copied into the host partition. This is what
``zbench.cases.formulas.placement`` predicts.
"""

from __future__ import annotations

import torch

from zbench.implementations.zero.comm import Comm
from zbench.implementations.zero.masters import InMemoryMasters, MasterStore
from zbench.implementations.zero.nvme import DiskShard, NvmeMasters
from zbench.implementations.zero.offload import DeviceToHost, HostGradShard, HostShard, HostToDevice
from zbench.implementations.zero.options import ZeroOptions
from zbench.implementations.zero.state import Held
from zbench.implementations.zero.swap import SwapDir
from zbench.implementations.zero.tiers import DeviceGradShard, DeviceShard, GradShard, ParamTier, ReducedSlice
from zbench.protocol import TrainSpec

#: Offload modes per stage: parameters can only leave the device when they are partitioned (stage 3).
SUPPORTED = {
    1: frozenset({"none", "optimizer", "nvme"}),
    2: frozenset({"none", "optimizer", "nvme"}),
    3: frozenset({"none", "optimizer", "optimizer+params", "nvme"}),
}


class Placement:
    """The master store and the factories of shard tiers for one engine, plus what they hold.

    ``close`` releases what outlives the engine's tensors (the swap files and their I/O thread).
    """

    def __init__(
        self, spec: TrainSpec, options: ZeroOptions, comm: Comm, *, stage: int, per_parameter: bool = False
    ) -> None:
        """``per_parameter``: the model may leave parameters without a gradient, which the optimizer must then
        skip as DDP's does (``unused``); the in-memory stores step parameter by parameter for it."""
        if spec.offload not in SUPPORTED[stage]:
            raise ValueError(
                f"zero{stage}: offload {spec.offload!r} not supported (supports {sorted(SUPPORTED[stage])})"
            )
        if per_parameter and spec.offload == "nvme":
            raise ValueError(
                f"zero{stage}: offload 'nvme' steps flat sub-groups of the masters and cannot skip a parameter no "
                "rank used, as DDP does; this model may leave parameters without a gradient (model.unused_parameters)"
            )
        self.offload, self.stage, self.device = spec.offload, stage, spec.device
        self.swap = SwapDir(spec.nvme_dir, rank=comm.rank) if spec.offload == "nvme" else None
        offloaded = spec.offload != "none"
        self._d2h = DeviceToHost(spec.device) if offloaded else None
        self._h2d = HostToDevice(spec.device) if spec.offload in ("optimizer+params", "nvme") and stage == 3 else None
        self.masters: MasterStore
        if self.swap is not None:
            self.masters = NvmeMasters(spec, swap=self.swap, chunk_numel=options.nvme_chunk_numel)
        else:
            self.masters = InMemoryMasters(spec, home="host" if offloaded else "device", per_parameter=per_parameter)

    def param_tier(self, shard: torch.Tensor) -> ParamTier:
        """Stage 3: where this rank's compute-dtype parameter shard (``shard``, on the device) is kept."""
        if self.stage == 3 and self.offload == "optimizer+params":
            assert self._h2d is not None
            return HostShard(shard, h2d=self._h2d)
        if self.stage == 3 and self.offload == "nvme":
            assert self.swap is not None and self._h2d is not None
            return DiskShard(shard, swap=self.swap, h2d=self._h2d)
        return DeviceShard(shard)

    def grad_shard(self, numel: int, *, dtype: torch.dtype) -> GradShard:
        """Stages 2 and 3: the persistent gradient shard of one bucket (device, compute dtype; or host, fp32)."""
        if self._d2h is None:
            return DeviceGradShard(numel, dtype=dtype, device=self.device)
        return HostGradShard(numel, d2h=self._d2h)

    def reduced_grad(self, numel: int) -> GradShard:
        """Stage 1: where the optimizer reads one bucket's reduced slice (in the bucket, or copied to the host)."""
        return ReducedSlice() if self._d2h is None else HostGradShard(numel, d2h=self._d2h)

    def held(self) -> dict[str, Held]:
        held = self.masters.held()
        disk = self.swap.disk_bytes("parameters") if self.swap is not None else 0
        return {**held, "parameters": Held(disk=disk)}

    def buffer_bytes(self) -> dict[str, int]:
        return self.masters.buffer_bytes()

    def close(self) -> None:
        self.masters.close()
        if self.swap is not None:
            self.swap.close()
