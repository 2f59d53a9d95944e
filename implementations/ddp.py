"""PyTorch DistributedDataParallel: the reference every other implementation is checked against."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from zbench.implementations._common import (
    accumulate,
    autocast,
    full_parameters_of,
    global_grad_norm,
    grad_scaler,
    may_leave_unused,
    maybe,
)
from zbench.protocol import Capabilities, EngineBase, ImplementationBase, MicroBatch, TrainSpec, Tunable
from zbench.state_bytes import module_state_bytes

#: DDP's gradient bucket cap (torch's default), MiB: the one option the adapter reads (``bucket_mb``).
DEFAULT_BUCKET_MB = 25.0


def bucket_mb(spec: TrainSpec) -> float:
    """The suite's ``options: {bucket_mb: ...}`` (torch's ``bucket_cap_mb``), checked; other options are ignored, as
    a suite may give every implementation the same ``options``."""
    value = spec.options.get("bucket_mb", DEFAULT_BUCKET_MB)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"ddp option bucket_mb must be a number > 0, got {value!r}")
    return float(value)


class DDPEngine(EngineBase):
    """Replicated parameters, gradients and optimizer state; gradients all-reduced in buckets during backward."""

    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        self.spec = spec
        self.module = model
        device_ids = [spec.device.index] if spec.device.type == "cuda" else None
        # A model whose parameters may get no gradient in a step (experts no token reached) says so; DDP then finds
        # them after each backward, leaves a parameter no rank used without a gradient (AdamW skips it) and
        # reduces zeros for one this rank did not use. Not while tracing (fake tensors): the traced model spreads
        # its tokens over every expert, and DDP's search reads values fake tensors do not have.
        tracing = any(isinstance(p, FakeTensor) for p in model.parameters())
        self.ddp = DistributedDataParallel(
            model,
            process_group=group,
            device_ids=device_ids,
            find_unused_parameters=may_leave_unused(model) and not tracing,
            bucket_cap_mb=bucket_mb(spec),
        )
        self.optimizer = spec.make_optimizer(model.parameters())
        self.scaler = grad_scaler(spec)
        self.grad_norm: torch.Tensor | None = None

    def _forward_backward(self, batch: MicroBatch, is_last: bool, n: int) -> torch.Tensor:
        with maybe(None if is_last else self.ddp.no_sync()):
            with autocast(self.spec):
                loss = self.ddp(*batch)
            self.scaler.scale(loss / n).backward()
        return loss

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = accumulate(micro_batches, lambda b, last: self._forward_backward(b, last, len(micro_batches)))
        self.scaler.unscale_(self.optimizer)  # a no-op unless fp16: the norm is the true gradient's
        self.grad_norm = global_grad_norm(self.module.parameters())
        if self.spec.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(self.module.parameters(), self.spec.grad_clip, self.grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return full_parameters_of(self.module)

    def state_bytes(self) -> dict[str, dict[str, int]]:
        return module_state_bytes(self.module.parameters(), self.optimizer, compute_device=self.spec.device)

    def metrics(self) -> dict[str, float]:
        out = {"grad_norm": float(self.grad_norm)} if self.grad_norm is not None else {}
        return {**out, "loss_scale": self.scaler.get_scale()} if self.scaler.is_enabled() else out


class DDP(ImplementationBase):
    name = "ddp"
    capabilities = Capabilities(
        stages=frozenset({0}),
        precisions=frozenset({"fp32", "bf16", "fp16"}),
        tunables=(
            Tunable(
                "bucket_mb", (DEFAULT_BUCKET_MB, 5.0, 100.0),
                trades="fewer, larger all-reduces (less latency) against a larger last bucket nothing hides",
            ),
        ),
        options=frozenset({"bucket_mb"}),
    )  # fmt: skip

    def build(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> DDPEngine:
        return DDPEngine(model, spec, group)


IMPLEMENTATION = DDP()
