"""A DeepSpeed change the model-state check must catch: it trains correctly but never frees a gradient buffer.

``LEAKY`` is the DeepSpeed adapter whose ZeRO optimizer, once built, also holds a whole fp32 gradient
(4 bytes per parameter) between steps, as a change that forgets to free its flat gradient buffer would.
Losses and parameters stay exactly DeepSpeed's, so only the bytes tell it apart (tests/test_deepspeed.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from zbench.implementations.deepspeed_zero import DeepSpeed, DeepSpeedEngine
from zbench.protocol import TrainSpec


class LeakyEngine(DeepSpeedEngine):
    def _build(self, rows: int) -> None:
        super()._build(rows)
        whole = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())  # stage 3: ds_numel
        self.optimizer.unfreed_gradient_buffer = torch.zeros(whole, device=self.spec.device)


class Leaky(DeepSpeed):
    name = "leaky_deepspeed"

    def build(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> LeakyEngine:
        return LeakyEngine(model, spec, group)


LEAKY = Leaky()
