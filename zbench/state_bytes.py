"""Model-state bytes measured from the tensors a rank actually holds: helpers for implementations.

Part of the protocol's toolkit (an implementation may import it; it imports nothing of the harness).
Adapters (DDP, FSDP, torch ZeRO) and the reference engine report ``Engine.state_bytes`` through these
helpers so that every implementation is counted the same way: each storage once,
DTensors by their local shard, by the device the bytes live on.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zbench.values import CATEGORIES, LOCATIONS


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2) holds only its shard
    return to_local() if callable(to_local) else t


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Which storage ``t`` views: its device and the storage object's identity.

    Not ``data_ptr()``: a fake tensor (``zbench plan --trace``) has no memory, every one reads 0.
    """
    return str(t.device), t.untyped_storage()._cdata


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` start at the same element of the same storage (for real and fake tensors alike)."""
    return storage_key(a) == storage_key(b) and a.storage_offset() * a.element_size() == (
        b.storage_offset() * b.element_size()
    )


def location_of(t: torch.Tensor) -> str:
    return "host" if t.device.type == "cpu" else "device"


def tensor_bytes(tensors: Iterable[torch.Tensor | None], *, compute_device: torch.device) -> dict[str, int]:
    """Bytes by location of ``tensors``, counting each underlying storage once.

    A tensor on ``compute_device`` counts as ``device`` even on a CPU-only run,
    so that on CPU the compute copy is still told apart from an offloaded copy
    (which an engine reports as ``host`` itself).
    """
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {loc: 0 for loc in LOCATIONS}
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.is_meta:  # a shape without memory (DeepSpeed keeps such stand-ins of its parameters)
            continue
        storage = t.untyped_storage()
        key = storage_key(t)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out["device" if t.device == compute_device else location_of(t)] += storage.nbytes()
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state except scalar step counters."""
    return [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    ]


def empty_state_bytes() -> dict[str, dict[str, int]]:
    return {c: {loc: 0 for loc in LOCATIONS} for c in CATEGORIES}


def module_state_bytes(
    params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, *, compute_device: torch.device
) -> dict[str, dict[str, int]]:
    """State bytes of a plain (non-ZeRO-layout) trainer: parameters, their ``.grad`` and the optimizer state."""
    params = list(params)
    out = empty_state_bytes()
    out["parameters"] = tensor_bytes(params, compute_device=compute_device)
    out["gradients"] = tensor_bytes((p.grad for p in params), compute_device=compute_device)
    out["optimizer_state"] = tensor_bytes(optimizer_tensors(optimizer), compute_device=compute_device)
    return out


def moved_to_host(state: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The same bytes counted as host memory: for trainers whose whole sharded state lives there
    (FSDP2's CPU offload), which on a CPU-only run would otherwise count as the compute device."""
    return {
        cat: {"device": 0, "host": locs["device"] + locs["host"], "disk": locs["disk"]} for cat, locs in state.items()
    }
