"""Where a step's time goes: forward, backward and optimizer, for any implementation, from hooks it cannot avoid.

- *forward*: from the model's forward pre-hook to its forward hook (summed over
  micro-batches). The hooks sit on the root module the harness built, which
  every implementation calls (DDP and FSDP wrap it; the ZeRO engine hooks its
  blocks), so its own gathers before forward are included.
- *optimizer*: from the first ``torch.optim.Optimizer.step`` of the step (a
  global step pre-hook, so any torch optimizer counts: DDP's, FSDP's, torch
  ZeRO's inner one, our engine's on its master shards) to the end of the step;
  what an engine does after the step (ZeRO-1/2's parameter all-gather) counts
  here.
- *backward*: the rest: backward, the gradient communication it did not hide,
  clipping and loss scaling.

On CUDA the marks are CUDA events recorded on the current stream and read once
the step has been synchronised, so they time the GPU's work rather than the
Python that queued it; on CPU they are ``time.perf_counter`` readings. An
implementation that calls no torch optimizer gets no optimizer phase (its time
stays in backward) and the split says so with ``None``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


class PhaseClock:
    """Marks one step's phases; ``attach`` before training, ``run`` each step, ``read`` after it has synchronised."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self._handles: list = []
        self._marks: list[tuple[str, Any]] = []
        self._active = False

    def attach(self) -> PhaseClock:
        if not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(lambda *_: self._mark("forward_start")),
                self.model.register_forward_hook(lambda *_: self._mark("forward_end")),
                register_optimizer_step_pre_hook(lambda *_: self._mark("optimizer", once=True)),
            ]
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self, name: str, *, once: bool = False) -> None:
        if self._active and not (once and any(n == name for n, _ in self._marks)):
            self._marks.append((name, self._now()))

    def run(self, step: Callable[[], Any]) -> Any:
        """Run one step between a start and an end mark."""
        self._marks = [("start", self._now())]
        self._active = True
        try:
            return step()
        finally:
            self._active = False
            self._marks.append(("end", self._now()))

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def read(self) -> dict[str, float | None]:
        """The last step's phases in seconds (call after the device has been synchronised)."""
        marks = self._marks
        start, end = marks[0][1], marks[-1][1]
        total = self._seconds(start, end)
        forward, opened = 0.0, None
        for name, at in marks:
            if name == "forward_start":
                opened = at
            elif name == "forward_end" and opened is not None:
                forward += self._seconds(opened, at)
                opened = None
        optimizer_at = next((at for name, at in marks if name == "optimizer"), None)
        optimizer = self._seconds(optimizer_at, end) if optimizer_at is not None else None
        return {
            "device_step_s": total if self.device.type == "cuda" else None,
            "forward_s": forward,
            "backward_s": total - forward - (optimizer or 0.0),
            "optimizer_s": optimizer,
        }


def clock_name(device: torch.device) -> str:
    return "CUDA events" if device.type == "cuda" else "perf_counter"
