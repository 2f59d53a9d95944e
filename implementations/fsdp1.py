"""PyTorch FSDP1 (``FullyShardedDataParallel``), still in many codebases: ZeRO stage 2 or 3 by sharding strategy.

- stage 3: ``FULL_SHARD`` (parameters, gradients and optimizer state sharded; each unit's
  parameters gathered for its forward and again for its backward);
- stage 2: ``SHARD_GRAD_OP`` (parameters stay gathered from forward to the end of backward,
  so they are gathered once per step; gradients and optimizer state sharded);
- stage 0: ``NO_SHARD`` (DDP's layout, all-reduced gradients), FSDP1's own data parallelism.

Each transformer block is its own FSDP unit (nested instances, then the root), as
``ModuleWrapPolicy`` over the block class would make them; ``use_orig_params=True`` so the
optimizer and the equivalence check see the model's own parameters. Mixed precision keeps the
sharded fp32 flat parameter and casts a compute copy for each forward (``MixedPrecision`` with
gradients reduced in fp32), the same layout as FSDP2. Offload: ``CPUOffload(offload_params=True)``
keeps the sharded parameters, their gradients and so the optimizer step on the host, which is the
suite's ``optimizer+params`` at stage 3; FSDP1 offloads nothing at the other strategies.

Option ``backward_prefetch`` (``pre``, its default, ``post`` or ``none``): when ``FULL_SHARD`` gathers the
next unit for backward. ``pre`` issues it before the current unit's gradients are computed, so the two overlap
and two units are gathered at once; ``post`` after them, and ``none`` only when backward reaches the next
unit, so that the gather waits in the open (torch's docs: no overlap, and not recommended) while one unit at a
time is held.
"""

from __future__ import annotations

import contextlib
import functools
from typing import cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)

from zbench.implementations._common import accumulate
from zbench.implementations.fsdp import root_stays_gathered, shard_groups
from zbench.protocol import Capabilities, EngineBase, ImplementationBase, MicroBatch, ModelShape, TrainSpec, Tunable
from zbench.state_bytes import module_state_bytes, moved_to_host

STRATEGY = {3: ShardingStrategy.FULL_SHARD, 2: ShardingStrategy.SHARD_GRAD_OP, 0: ShardingStrategy.NO_SHARD}
_PREFIX = "_fsdp_wrapped_module."
#: The suite option ``backward_prefetch`` by name: FSDP1's ``BackwardPrefetch`` (``pre`` is torch's default).
BACKWARD_PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}


def backward_prefetch(spec: TrainSpec) -> BackwardPrefetch | None:
    """The suite's ``options: {backward_prefetch: ...}``, checked; other options are ignored, as a suite may give
    every implementation the same ``options``."""
    value = spec.options.get("backward_prefetch", "pre")
    if not isinstance(value, str) or value not in BACKWARD_PREFETCH:
        raise ValueError(f"fsdp1 option backward_prefetch must be one of {', '.join(BACKWARD_PREFETCH)}, got {value!r}")
    return BACKWARD_PREFETCH[value]


class FSDP1Engine(EngineBase):
    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        self.spec = spec
        wrap = functools.partial(
            FullyShardedDataParallel,
            process_group=group,
            sharding_strategy=STRATEGY[spec.stage],
            mixed_precision=(
                MixedPrecision(param_dtype=spec.compute_dtype, reduce_dtype=torch.float32)
                if spec.precision != "fp32"
                else None
            ),
            cpu_offload=CPUOffload(offload_params=spec.offload == "optimizer+params"),
            backward_prefetch=backward_prefetch(spec),
            device_id=spec.device,  # named even on CPU, where FSDP1 otherwise looks for an accelerator
            use_orig_params=True,
        )
        for unit in shard_groups(model):
            if len(unit) == 1:  # blocks sharing parameters stay in the root's unit: FSDP1 wraps modules, not groups
                blocks = cast(nn.ModuleList, model.get_submodule("blocks"))
                index = next(i for i, b in enumerate(blocks) if b is unit[0])
                blocks[index] = wrap(unit[0])
        self.model = wrap(model)
        self.optimizer = spec.make_optimizer(self.model.parameters())
        self.grad_norm: torch.Tensor | None = None

    def _forward_backward(self, batch: MicroBatch, is_last: bool, n: int) -> torch.Tensor:
        # before the last micro-batch, accumulate locally (no reduction)
        with self.model.no_sync() if not is_last else contextlib.nullcontext():
            loss = self.model(*batch)
            (loss / n).backward()
        return loss

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = accumulate(micro_batches, lambda b, last: self._forward_backward(b, last, len(micro_batches)))
        # FSDP1's own clip reduces the sharded norm across ranks; an infinite limit leaves the gradients as they
        # are (the clip coefficient is clamped to 1) and still returns the global norm the harness compares
        clip = self.spec.grad_clip if self.spec.grad_clip is not None else float("inf")
        self.grad_norm = self.model.clip_grad_norm_(clip)
        self.optimizer.step()
        return loss

    def full_parameters(self) -> dict[str, torch.Tensor]:
        with FullyShardedDataParallel.summon_full_params(self.model, writeback=False):
            return {
                name.replace(_PREFIX, ""): p.detach().float().cpu().clone() for name, p in self.model.named_parameters()
            }

    def metrics(self) -> dict[str, float]:
        return {} if self.grad_norm is None else {"grad_norm": float(self.grad_norm)}

    def state_bytes(self) -> dict[str, dict[str, int]]:
        """The flat parameters' storages (each original parameter is a view of one), their gradients and the
        optimizer state, each storage counted once."""
        state = module_state_bytes(self.model.parameters(), self.optimizer, compute_device=self.spec.device)
        return moved_to_host(state) if self.spec.offload != "none" else state


class FSDP1(ImplementationBase):
    name = "fsdp1"
    capabilities = Capabilities(
        stages=frozenset(STRATEGY),
        precisions=frozenset({"fp32", "bf16"}),
        offload=frozenset({"none", "optimizer+params"}),
        offload_keeps_master=False,
        offload_devices=frozenset({"cuda"}),
        parameters_sharded_from_stage=2,
        collectives_block_on=frozenset({"gloo"}),  # no async_op anywhere: its overlap is CUDA streams
        tunables=(
            Tunable(
                "backward_prefetch", ("pre", "post"), stages=frozenset({3}), serialized_at=("post", "none"),
                serialized_phases=frozenset({"backward"}),
                trades="one unit's gathered parameters less at the peak against backward's gathers waited for",
            ),
        ),
        options=frozenset({"backward_prefetch"}),
    )  # fmt: skip

    def expected_comm_elements(self, shape: ModelShape, world: int, stage: int) -> int | None:
        """``FULL_SHARD`` as FSDP2: the root unit stays gathered from forward to backward (3Ψ less the root);
        ``SHARD_GRAD_OP`` and ``NO_SHARD`` as the formulas of stages 2 and 0 (2Ψ)."""
        return root_stays_gathered(shape) if stage == 3 else None

    def build(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> FSDP1Engine:
        return FSDP1Engine(model, spec, group)


IMPLEMENTATION = FSDP1()
