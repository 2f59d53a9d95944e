"""PyTorch's ZeroRedundancyOptimizer over DDP: ZeRO stage 1 (optimizer state sharded, gradients all-reduced)."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer

from zbench.implementations.ddp import DDPEngine
from zbench.protocol import Capabilities, ModelShape, TrainSpec
from zbench.state_bytes import module_state_bytes, optimizer_tensors, tensor_bytes


class TorchZeroEngine(DDPEngine):
    """DDP's training loop with the optimizer swapped for ``ZeroRedundancyOptimizer``."""

    optimizer: ZeroRedundancyOptimizer

    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        super().__init__(model, spec, group)
        cls, kwargs = spec.optimizer_class_and_kwargs()
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, process_group=group, **kwargs)

    def state_bytes(self) -> dict[str, dict[str, int]]:
        out = module_state_bytes(self.module.parameters(), self.optimizer.optim, compute_device=self.spec.device)
        out["optimizer_state"] = tensor_bytes(optimizer_tensors(self.optimizer.optim), compute_device=self.spec.device)
        return out


class TorchZero:
    name = "torch_zero"
    # which rank holds a tensor's optimizer state depends on every tensor of the model: not extrapolated over blocks
    capabilities = Capabilities(
        stages=frozenset({1}), precisions=frozenset({"fp32", "bf16"}), blockwise=False, options=frozenset()
    )

    def expected_comm_elements(self, shape: ModelShape, world: int, stage: int) -> int:
        """Not ZeRO-1's optimal 2Ψ: DDP all-reduces every gradient (2Ψ), then each rank broadcasts its shard (Ψ)."""
        return 3 * shape.num_parameters

    def build(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> TorchZeroEngine:
        return TorchZeroEngine(model, spec, group)


IMPLEMENTATION = TorchZero()
