"""Small pieces the adapter implementations share: precision contexts and micro-batch loops."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from zbench.protocol import MicroBatch, TrainSpec


def may_leave_unused(model: torch.nn.Module) -> bool:
    """Whether the model declares that some parameters may get no gradient in a step (``module.unused_parameters``:
    experts no token reached), which DDP, FSDP2 and the reference engine each handle their own way."""
    return bool(getattr(model, "unused_parameters", False))


def autocast(spec: TrainSpec) -> contextlib.AbstractContextManager:
    """Autocast to the spec's compute dtype, or nothing for fp32."""
    if spec.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(spec.device.type, dtype=spec.compute_dtype)


def grad_scaler(spec: TrainSpec) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16; a disabled (pass-through) scaler otherwise."""
    return torch.amp.GradScaler(spec.device.type, enabled=spec.precision == "fp16")


def accumulate(
    micro_batches: list[MicroBatch], forward_backward: Callable[[MicroBatch, bool], torch.Tensor]
) -> torch.Tensor:
    """Run ``forward_backward(batch, is_last)`` over every micro-batch; return the mean loss, detached."""
    total = torch.zeros((), device=micro_batches[0][0].device)
    for i, batch in enumerate(micro_batches):
        total += forward_backward(batch, i == len(micro_batches) - 1).detach().float()
    return total / len(micro_batches)


@contextlib.contextmanager
def maybe(ctx: contextlib.AbstractContextManager | None) -> Iterator[None]:
    with ctx if ctx is not None else contextlib.nullcontext():
        yield


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, as a tensor (no host sync inside the timed step).

    Sharded gradients (FSDP2's DTensors) are reduced across the group, one scalar all-reduce.
    The harness compares it with DDP's at every step: AdamW hides a constant gradient scale
    from the loss and the parameters, the norm does not (docs/methods.md#equivalence).
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=False)
    full = getattr(total, "full_tensor", None)
    return full() if callable(full) else total


def full_parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Replicated parameters as fp32 CPU copies; DTensors are gathered first (a collective)."""
    out = {}
    for name, p in module.named_parameters():
        full = getattr(p, "full_tensor", None)
        t = full() if callable(full) else p
        out[name] = t.detach().float().cpu().clone()
    return out
