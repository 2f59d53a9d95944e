"""PyTorch FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded, i.e. ZeRO stage 3.

Each transformer block is its own FSDP unit (gathered before its forward,
resharded after), then the root module, the layout torchtitan uses.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from implementations._common import accumulate, full_parameters_of
from zbench.measure.state import module_state_bytes
from zbench.protocol import Capabilities, MicroBatch, TrainSpec


class FSDPEngine:
    def __init__(self, model: nn.Module, spec: TrainSpec, group) -> None:
        self.spec = spec
        mesh = DeviceMesh.from_group(group, spec.device.type) if group is not None else None
        policy = MixedPrecisionPolicy(param_dtype=spec.compute_dtype if spec.precision != "fp32" else None,
                                      reduce_dtype=torch.float32)
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        self.model = fully_shard(model, mesh=mesh, mp_policy=policy)
        self.optimizer = spec.make_optimizer(self.model.parameters())

    def _forward_backward(self, batch: MicroBatch, is_last: bool, n: int) -> torch.Tensor:
        self.model.set_requires_gradient_sync(is_last)
        loss = self.model(*batch)  # MixedPrecisionPolicy casts; no autocast needed
        (loss / n).backward()
        return loss

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = accumulate(micro_batches, lambda b, last: self._forward_backward(b, last, len(micro_batches)))
        if self.spec.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
        self.optimizer.step()
        return loss

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return full_parameters_of(self.model)

    def state_bytes(self) -> dict[str, dict[str, int]]:
        return module_state_bytes(self.model.parameters(), self.optimizer, compute_device=self.spec.device)


class FSDP:
    name = "fsdp"
    capabilities = Capabilities(stages=frozenset({3}), precisions=frozenset({"fp32", "bf16"}))

    def expected_comm_elements(self, cfg, world: int) -> int:
        """Design's 3Ψ less one gather of the root unit: FSDP2 keeps the root's parameters gathered from
        forward to backward, so only the blocks are gathered twice."""
        root = cfg.num_parameters - cfg.layers * cfg.block_parameters
        return 3 * cfg.num_parameters - root

    def build(self, model: nn.Module, spec: TrainSpec, group) -> FSDPEngine:
        return FSDPEngine(model, spec, group)


IMPLEMENTATION = FSDP()
