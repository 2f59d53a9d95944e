"""Loss scaling for fp16: torch.amp.GradScaler's rules, for gradients that live in shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zbench.implementations.zero.options import ZeroOptions
from zbench.protocol import TrainSpec


@dataclass(kw_only=True)
class LossScaler:
    """Dynamic loss scaling; disabled (scale 1, never overflows) unless training in fp16.

    Same rules as ``torch.amp.GradScaler``: on an overflow (a non-finite gradient on any rank) the
    step is skipped and the scale multiplied by ``backoff_factor``; after ``growth_interval`` steps
    without one it is multiplied by ``growth_factor``.
    """

    enabled: bool
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    overflow: bool = False
    """Whether the last step overflowed (and was skipped)."""
    skipped_steps: int = 0

    @classmethod
    def for_spec(cls, spec: TrainSpec, options: ZeroOptions) -> LossScaler:
        return cls(
            enabled=spec.precision == "fp16",
            scale=float(options.initial_loss_scale),
            growth_interval=options.loss_scale_growth_interval,
        )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def update(self, overflow: bool) -> None:
        self.overflow = overflow
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def metrics(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        return {"loss_scale": self.scale, "overflow": float(self.overflow), "skipped_steps": float(self.skipped_steps)}

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
