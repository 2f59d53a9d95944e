"""PyTorch FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded, at ZeRO stage 3 or 2.

Each transformer block is its own FSDP unit, then the root module, the layout
torchtitan uses. The stage is FSDP2's ``reshard_after_forward``:

- stage 3: torch's default (``True`` for every unit but the root): each unit
  is gathered before its forward, freed after it and gathered again for its
  backward (3Ψ less the root, which stays gathered from forward to backward);
- stage 2: ``False``: each unit stays gathered from its forward to the end of
  its backward, so it is gathered once per step (2Ψ), and freed after it; as
  FSDP1's ``SHARD_GRAD_OP``, parameters are sharded between steps (stage 3's
  model states) and whole during the step (stage 2's peak and traffic).

Offload: FSDP2's ``CPUOffloadPolicy`` keeps the sharded fp32 parameters, their
gradients and the optimizer state on the host and runs the optimizer step
there; parameters are copied to the device before each unit's all-gather. That
is the suite's ``optimizer+params`` mode, at stage 3 (the formulas hold parameter
offload to stage 3); FSDP2 cannot offload the optimizer alone nor to NVMe, so
those modes are skipped with that reason.

Option ``prefetch`` (0, its default, 1 or 2): how many units ahead each unit issues its all-gathers
(``set_modules_to_forward_prefetch`` and ``..._backward_prefetch``, torchtitan's explicit prefetching). At 0 torch
schedules them itself: in forward each unit's gather is issued when its forward begins (the host running ahead of
the GPU issues it early), in backward the next unit's is issued ahead implicitly. At ``n`` each unit issues the
next ``n`` units' gathers before its own compute, on FSDP2's all-gather stream, and up to ``n`` more units are
gathered at once. On a CPU nothing overlaps either way: FSDP2 calls its collectives synchronously (no
``async_op``; its overlap is CUDA streams), so a prefetched gather blocks the rank where it is issued. ``zbench
tune`` does not search it (docs/methods.md#tuning-zbench-tune): its step model has nothing to rank it by.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from zbench.implementations._common import accumulate, full_parameters_of, global_grad_norm, may_leave_unused
from zbench.protocol import Capabilities, EngineBase, MicroBatch, ModelShape, TrainSpec, root_held
from zbench.state_bytes import module_state_bytes, moved_to_host


def shard_groups(model: nn.Module) -> list[list[nn.Module]]:
    """The FSDP groups below the root: one per block, except that blocks sharing a parameter form one group
    (FSDP2 refuses a parameter managed by two groups) and blocks sharing one with the root stay in the root's."""
    blocks = list(getattr(model, "blocks", []))
    ids = [{id(p) for p in block.parameters()} for block in blocks]
    in_root = root_held(model, blocks)
    groups: list[set[int]] = []
    for i in range(len(blocks)):
        touching = [g for g in groups if any(ids[i] & ids[j] for j in g)]
        groups = [g for g in groups if g not in touching] + [{i}.union(*touching)]
    kept = [sorted(g) for g in groups if not set().union(*(ids[j] for j in g)) & in_root]
    return [[blocks[j] for j in g] for g in sorted(kept)]


def root_stays_gathered(shape: ModelShape) -> int:
    """ZeRO-3's 3Ψ less one gather of the root unit: FSDP (2, and 1's ``FULL_SHARD``) keeps the root's
    parameters gathered from forward to backward, so only the blocks are gathered twice (blocks that share a weight
    are one unit: ``shard_groups``)."""
    return 3 * shape.num_parameters - (shape.root_parameters - shape.shared_block_parameters)


def prefetch_depth(spec: TrainSpec) -> int:
    """The suite's ``options: {prefetch: n}``, checked (0: torch's own scheduling); other options are ignored, as a
    suite may give every implementation the same ``options``."""
    value = spec.options.get("prefetch", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"fsdp option prefetch must be a whole number of units >= 0, got {value!r}")
    return value


def set_prefetch(units: list[FSDPModule], depth: int) -> None:
    """Each unit (in forward order, the root first) issues the gathers of the next ``depth`` units before its
    forward and of the ``depth`` before it before its backward; 0 leaves torch's own scheduling."""
    if depth == 0:
        return
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + depth])
        if i > 0:  # the root's backward comes last: nothing is left to gather after it
            unit.set_modules_to_backward_prefetch(units[max(1, i - depth) : i][::-1])


class FSDPEngine(EngineBase):
    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        self.spec = spec
        mesh = DeviceMesh.from_group(group, spec.device.type) if group is not None else None
        policy = MixedPrecisionPolicy(
            param_dtype=spec.compute_dtype if spec.precision != "fp32" else None, reduce_dtype=torch.float32
        )
        offload = (
            CPUOffloadPolicy(pin_memory=spec.device.type == "cuda")
            if spec.offload == "optimizer+params"
            else OffloadPolicy()
        )
        shard = functools.partial(fully_shard, mesh=mesh, mp_policy=policy, offload_policy=offload)
        if spec.stage == 2:  # each unit stays gathered from its forward to its backward
            shard = functools.partial(shard, reshard_after_forward=False)
        # (stage 3 leaves torch's default, which reshards every unit but the root; an explicit True would regather
        # the root for backward too)
        units = []
        for blocks in shard_groups(model):
            shard(blocks)
            units.append(cast(FSDPModule, blocks[0]))  # a group's modules share one FSDP state
        sharded = shard(model)
        assert isinstance(sharded, nn.Module)  # ``model`` itself, its class now a subclass of FSDPModule too
        set_prefetch([cast(FSDPModule, sharded), *units], prefetch_depth(spec))
        if may_leave_unused(model) and hasattr(sharded, "set_reduce_scatter_unused_params"):
            # FSDP2's setting for experts no token reached: zeros from a rank that did not use a parameter, as
            # DDP's find_unused_parameters; without it the ranks' reduce-scatters differ in size and gloo aborts.
            # A parameter no rank used then gets a zero gradient, which AdamW steps where DDP's skips it
            # (docs/methods.md#mixture-of-experts).
            sharded.set_reduce_scatter_unused_params(True)
        self.model = sharded
        self.optimizer = spec.make_optimizer(self.model.parameters())
        self.grad_norm: torch.Tensor | None = None

    def _forward_backward(self, batch: MicroBatch, is_last: bool, n: int) -> torch.Tensor:
        self.model.set_requires_gradient_sync(is_last)
        loss = self.model(*batch)  # MixedPrecisionPolicy casts; no autocast needed
        (loss / n).backward()
        return loss

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = accumulate(micro_batches, lambda b, last: self._forward_backward(b, last, len(micro_batches)))
        if self.spec.grad_clip is not None:  # the DTensor-aware clip; its norm is sharded (partial) until gathered
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
        else:
            self.grad_norm = global_grad_norm(self.model.parameters())
        self.optimizer.step()
        return loss

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return full_parameters_of(self.model)

    def metrics(self) -> dict[str, float]:
        if self.grad_norm is None:
            return {}
        full = getattr(self.grad_norm, "full_tensor", None)
        return {"grad_norm": float(full() if callable(full) else self.grad_norm)}

    def state_bytes(self) -> dict[str, dict[str, int]]:
        state = module_state_bytes(self.model.parameters(), self.optimizer, compute_device=self.spec.device)
        return moved_to_host(state) if self.spec.offload != "none" else state


class FSDP:
    name = "fsdp"
    capabilities = Capabilities(
        stages=frozenset({2, 3}),
        precisions=frozenset({"fp32", "bf16"}),
        offload=frozenset({"none", "optimizer+params"}),
        offload_keeps_master=False,
        parameters_sharded_from_stage=2,
        shards_parameters_by_rows=True,
        collectives_block_on=frozenset({"gloo"}),  # no async_op: its overlap is CUDA streams (module docstring)
        options=frozenset({"prefetch"}),
    )

    def expected_comm_elements(self, shape: ModelShape, world: int, stage: int) -> int | None:
        """Stage 3: 3Ψ less the root, which stays gathered from forward to backward; stage 2: the formula's 2Ψ."""
        return root_stays_gathered(shape) if stage == 3 else None

    def build(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> FSDPEngine:
        return FSDPEngine(model, spec, group)


IMPLEMENTATION = FSDP()
