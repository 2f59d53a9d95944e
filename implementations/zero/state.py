"""What a rank holds, for ``state_bytes``, and the whole model gathered back, for ``full_parameters``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from implementations.zero.comm import Comm
from implementations.zero.optim import ShardedOptimizer
from zbench.measure.state import empty_state_bytes, optimizer_tensors, tensor_bytes


def zero_state_bytes(*, parameters: Iterable[torch.Tensor], gradients: Iterable[torch.Tensor],
                     optimizer: ShardedOptimizer, device: torch.device) -> dict[str, dict[str, int]]:
    """Bytes by category, measured from the tensors held (a freed stage-3 buffer holds zero bytes).

    fp32 master shards are slices of the parameters and count there; mixed precision masters count
    as ``master_weights``.
    """
    out = empty_state_bytes()
    out["parameters"] = tensor_bytes(parameters, compute_device=device)
    out["gradients"] = tensor_bytes(gradients, compute_device=device)
    out["optimizer_state"] = tensor_bytes(optimizer_tensors(optimizer.optimizer), compute_device=device)
    out["master_weights"] = tensor_bytes(optimizer.separate_masters, compute_device=device)
    return out


def gather_full_parameters(groups: Sequence, *, comm: Comm, order: Sequence[str]) -> dict[str, torch.Tensor]:
    """Every parameter in fp32 on the CPU, all-gathered from the master shards, keyed and ordered by ``order``.

    Collective: every rank must call it.
    """
    out: dict[str, torch.Tensor] = {}
    for group in groups:
        full = torch.empty(group.layout.padded_numel, dtype=torch.float32, device=group.master.device)
        comm.all_gather(full, group.master)
        for name, view in zip(group.layout.names, group.layout.views(full)):
            out[name] = view.detach().cpu().clone()
    return {name: out[name] for name in order}
