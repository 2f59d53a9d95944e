"""Small pieces the adapter implementations share: precision contexts and micro-batch loops."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

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


#: Elements per row of the gradient norm's partial sums (``sum_of_squares``).
NORM_ROW = 1 << 16


def sum_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """The sum of ``grad``'s squares in float64, from the norms of rows of ``NORM_ROW`` elements.

    Note: torch's CPU norm of one long fp32 vector drifts with its length: relative error 1e-5 at 1M
    elements, 1.5e-3 at 28M, 1% at 100M (randn, 2026-11-29, the 2-core machine); row by row it stays
    within 2e-7 at 100M, as fast. The reference engine's flat group is as long as its bucket (with
    offload its norm runs on the host's shards), and DDP's largest gradient as long as its largest
    parameter: a 190 MiB bucket of ``medium`` reported a norm 0.23% below DDP's and clipped differently
    (parameters 1.7e-4 apart), and DDP's own norm, per parameter, was 1e-4 off at 6.3M elements
    (docs/methods.md#equivalence).
    """
    flat = grad.reshape(-1)
    if not flat.numel():  # a rank's shard of a group smaller than the world
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    whole = flat.numel() // NORM_ROW * NORM_ROW
    parts = [torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1)] if whole else []
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    return (torch.cat(parts).double() ** 2).sum()


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, as a tensor (no host sync inside the timed step).

    Each gradient's squares are summed row by row (``sum_of_squares``), on each rank's shard where it is sharded
    (FSDP2's DTensors), then over the mesh dimensions it is sharded on: one scalar all-reduce per such set of
    dimensions, none for replicated gradients (DDP's, or a replicated DTensor, counted once). torch's own reduction
    (``get_total_norm``) takes each shard's norm in one piece, whose drift with length put FSDP2's norm 9.2e-4
    from DDP's at ``medium``, world 1 (92% of the check's bound; 2026-12-02). A gradient that is still a partial
    sum cannot be squared shard by shard: it goes to torch's reduction. The harness compares the norm with DDP's
    at every step: AdamW hides a constant gradient scale from the loss and the parameters, the norm does not
    (docs/methods.md#equivalence).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if any(p.is_partial() for g in grads if isinstance(g, DTensor) for p in g.placements):
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        full = getattr(norm, "full_tensor", None)
        return (full() if callable(full) else norm).float()
    by_sharded_dims: dict[tuple[int, ...], list[torch.Tensor]] = {}
    mesh = None
    for g in grads:
        local, dims = g, tuple[int, ...]()
        if isinstance(g, DTensor):
            mesh, local = g.device_mesh, g.to_local()
            dims = tuple(i for i, p in enumerate(g.placements) if p.is_shard())
        by_sharded_dims.setdefault(dims, []).append(sum_of_squares(local.detach()))
    total: torch.Tensor | None = None
    for dims, parts in by_sharded_dims.items():  # the same keys in the same order on every rank
        squares = torch.stack([part.to(parts[0].device) for part in parts]).sum()
        for dim in dims:
            assert mesh is not None
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total = squares if total is None else total + squares.to(total.device)
    assert total is not None
    return total.sqrt().float()


def full_parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Replicated parameters as fp32 CPU copies; DTensors are gathered first (a collective)."""
    out = {}
    for name, p in module.named_parameters():
        full = getattr(p, "full_tensor", None)
        t = full() if callable(full) else p
        out[name] = t.detach().float().cpu().clone()
    return out
