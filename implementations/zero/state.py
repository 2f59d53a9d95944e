"""What a rank holds, for ``state_bytes``, and the whole model gathered back, for ``full_parameters``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from zbench.implementations.zero.comm import Comm
from zbench.implementations.zero.flat import FlatLayout
from zbench.state_bytes import empty_state_bytes, storage_key


@dataclass
class Held:
    """Tensors a rank holds, by where they live, and the bytes it keeps in files.

    Note: the location is said by whoever holds the tensor, not read off ``tensor.device``: on a
    CPU-only run the compute device is the CPU too, and an offloaded host copy must still count as
    ``host``, apart from the compute copy.
    """

    device: Sequence[torch.Tensor | None] = field(default_factory=list)
    host: Sequence[torch.Tensor | None] = field(default_factory=list)
    disk: int = 0
    """Bytes in files (their sizes on disk as ``os.stat`` reports them)."""

    def __add__(self, other: Held) -> Held:
        return Held([*self.device, *other.device], [*self.host, *other.host], self.disk + other.disk)

    def bytes(self) -> dict[str, int]:
        """Bytes by location, each storage counted once (views of one flat buffer are one buffer)."""
        seen: set[tuple[str, int]] = set()
        out = {"device": 0, "host": 0, "disk": self.disk}
        for location, tensors in (("device", self.device), ("host", self.host)):
            for t in tensors:
                if t is None:
                    continue
                storage = t.untyped_storage()
                key = storage_key(t)
                if key in seen or storage.nbytes() == 0:
                    continue
                seen.add(key)
                out[location] += storage.nbytes()
        return out


def total(held: Iterable[Held]) -> Held:
    return sum(held, Held())


def zero_state_bytes(*, parameters: Held, gradients: Held, placed: dict[str, Held]) -> dict[str, dict[str, int]]:
    """Bytes by category and location, measured from what is held (a freed stage-3 buffer holds zero bytes).

    ``parameters`` and ``gradients`` are what the stage holds itself (the model's parameters, its
    gradient buffers and shards); ``placed`` (``Placement.held()``) adds the master weights and
    optimizer state wherever they live, and the parameters it keeps in files. fp32 master shards on the device are the
    parameter shards themselves and count there only.
    """
    out = empty_state_bytes()
    out["parameters"] = (parameters + placed["parameters"]).bytes()
    out["gradients"] = gradients.bytes()
    out["optimizer_state"] = placed["optimizer_state"].bytes()
    out["master_weights"] = placed["master_weights"].bytes()
    return out


def gather_full_parameters(
    layouts: Sequence[FlatLayout],
    masters: Iterable[torch.Tensor],
    *,
    comm: Comm,
    order: Sequence[str],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every parameter in fp32 on the CPU, all-gathered from the master shards, keyed and ordered by ``order``.

    ``masters`` yields each group's fp32 master shard in turn (wherever it lives: it is moved to the
    compute device for the collective). Collective: every rank must call it.
    """
    out: dict[str, torch.Tensor] = {}
    for layout, master in zip(layouts, masters, strict=True):
        full = torch.empty(layout.padded_numel, dtype=torch.float32, device=device)
        comm.all_gather(full, master.to(device))
        for name, view in zip(layout.names, layout.views(full)):
            out[name] = view.detach().cpu().clone()
    return {name: out[name] for name in order}
