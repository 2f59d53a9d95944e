"""The master store: this rank's fp32 master shards and their optimizer state, and the optimizer step over them.

``ShardedOptimizer`` does what needs the whole group (unscaling, the global gradient norm,
clipping) and hands the finished fp32 gradient shards to a store, which steps wherever the state
lives and writes the updated values back into each group's compute-dtype shard (its
``tiers.ParamTier``):

- ``InMemoryMasters(home="device")``: no offload; in fp32 the master *is* the parameter shard
  (no extra copy, as the ZeRO formulas assume);
- ``InMemoryMasters(home="host")``: ZeRO-Offload; masters and state in (pinned) host memory,
  always fp32 tensors of their own, stepped by the CPU;
- ``nvme.NvmeMasters``: ZeRO-Infinity; masters and state in files, streamed through a few buffers.

Every store saves and loads the same checkpoint layout (the torch optimizer's ``state_dict`` over
one flat master per group), so a checkpoint written under one offload mode resumes under another.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal, Protocol

import torch

from zbench.implementations.zero.offload import host_empty, upload_fence
from zbench.implementations.zero.state import Held
from zbench.implementations.zero.tiers import DeviceShard, ParamTier
from zbench.protocol import TrainSpec
from zbench.state_bytes import optimizer_tensors

Segment = tuple[int, int, int]
"""``(parameter index in its group, start, stop)`` within a shard."""


class MasterStore(Protocol):
    home: torch.device
    """Where the step runs: the gradient shards handed to ``step`` must live there."""

    def add(self, master: torch.Tensor, tier: ParamTier, segments: Sequence[Segment]) -> None:
        """Take one flat group's initial fp32 master shard (the store keeps it or copies it away), its shard tier,
        and where each parameter's piece lies in the shard (``FlatLayout.shard_segments``)."""

    def step(self, grads: Sequence[torch.Tensor], *, skip: Sequence[set[int]] | None = None) -> None:
        """Apply the optimizer with these finished fp32 gradient shards (one per group) and update every tier;
        ``skip``: per group, the parameters to leave untouched (``unused``: no rank used them)."""

    def masters(self) -> Iterator[torch.Tensor]:
        """Each group's fp32 master shard in turn (read back from disk when it lives there)."""

    def state_dict(self) -> dict:
        """``{"masters": [...], "optimizer": torch-optimizer state dict over one flat master per group}``."""

    def load_state_dict(self, state: dict) -> None:
        """Restore masters and optimizer state, and rewrite every compute shard from its master."""

    def held(self) -> dict[str, Held]:
        """``{"optimizer_state": ..., "master_weights": ...}`` by location."""

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes by location of the reusable buffers the step streams state through (none in memory)."""

    def close(self) -> None: ...


def check_masters(saved: Sequence[torch.Tensor], numels: Sequence[int]) -> None:
    if len(saved) != len(numels):
        raise ValueError(f"checkpoint has {len(saved)} master shards, this engine {len(numels)}")
    for t, n in zip(saved, numels):
        if t.shape != (n,):
            raise ValueError(f"checkpoint master shard has shape {tuple(t.shape)}, expected ({n},)")


class InMemoryMasters:
    """Masters and optimizer state as tensors in memory: on the device (no offload) or on the host (ZeRO-Offload).

    One flat master per group, one ``spec.make_optimizer`` over all of them (created on first use,
    after every group was added).

    ``per_parameter``: the optimizer steps each parameter's piece of each master (a view of it) as a tensor of its
    own, with its own state, so that a parameter no rank used is skipped as DDP's AdamW skips it (no decay, no
    moment update, its step count held: ``unused``). Only for models that may leave parameters unused: a flat
    master is one kernel per step where pieces are one per parameter.
    """

    def __init__(self, spec: TrainSpec, *, home: Literal["device", "host"], per_parameter: bool = False) -> None:
        self.spec = spec
        self.per_parameter = per_parameter
        self._pieces: list[list[tuple[int, int, torch.Tensor]]] = []
        """Per group, when ``per_parameter``: (parameter index, start in the shard, the master's piece)."""
        self.device = spec.device
        self.location = home
        self.home = spec.device if home == "device" else torch.device("cpu")
        self._masters: list[torch.Tensor] = []
        self._separate: list[bool] = []
        self._tiers: list[ParamTier] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._uploaded: torch.cuda.Event | None = None

    def add(self, master: torch.Tensor, tier: ParamTier, segments: Sequence[Segment]) -> None:
        if self._optimizer is not None:
            raise RuntimeError("all groups must be added before the first step")
        aliased = self.location == "device" and isinstance(tier, DeviceShard) and tier.tensor is master
        if self.location == "host":
            master = host_empty(master.numel(), torch.float32, device=self.device).copy_(master)
        self._masters.append(master)
        self._separate.append(not aliased)
        self._tiers.append(tier)
        if self.per_parameter:
            self._pieces.append([(index, start, master.detach()[start:stop]) for index, start, stop in segments])

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            stepped = (
                [piece for pieces in self._pieces for _, _, piece in pieces] if self.per_parameter else self._masters
            )
            self._optimizer = self.spec.make_optimizer(stepped)
        return self._optimizer

    def _wait_uploads(self) -> None:
        """Host masters on CUDA: block until the last step's copies to the device have read them."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def _update_tiers(self) -> None:
        for master, tier in zip(self._masters, self._tiers):
            tier.update(0, master.numel(), master)
        if self.location == "host":
            self._uploaded = upload_fence(self.device)

    def step(self, grads: Sequence[torch.Tensor], *, skip: Sequence[set[int]] | None = None) -> None:
        self._wait_uploads()
        if self.per_parameter:
            self._step_pieces(grads, skip or [set() for _ in grads])
        else:
            for master, grad in zip(self._masters, grads, strict=True):
                master.grad = grad
            self.optimizer.step()
            for master in self._masters:
                master.grad = None
        self._update_tiers()

    def _step_pieces(self, grads: Sequence[torch.Tensor], skip: Sequence[set[int]]) -> None:
        """Each parameter's piece gets its piece of the gradient, or none when no rank used the parameter."""
        for pieces, grad, skipped in zip(self._pieces, grads, skip, strict=True):
            for index, start, piece in pieces:
                piece.grad = None if index in skipped else grad[start : start + piece.numel()]
        self.optimizer.step()
        for pieces in self._pieces:
            for _, _, piece in pieces:
                piece.grad = None

    def masters(self) -> Iterator[torch.Tensor]:
        return iter(self._masters)

    def state_dict(self) -> dict:
        self._refuse_per_parameter_checkpoint()
        return {"masters": [m.detach().clone() for m in self._masters], "optimizer": self.optimizer.state_dict()}

    def _refuse_per_parameter_checkpoint(self) -> None:
        if self.per_parameter:
            raise NotImplementedError(
                "zero: checkpoints keep one optimizer state per flat master; a model with parameters that may go "
                "unused is stepped parameter by parameter, which no checkpoint layout holds yet"
            )

    def load_state_dict(self, state: dict) -> None:
        self._refuse_per_parameter_checkpoint()
        check_masters(state["masters"], [m.numel() for m in self._masters])
        self._wait_uploads()
        for master, saved in zip(self._masters, state["masters"]):
            master.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self._update_tiers()

    def held(self) -> dict[str, Held]:
        state = optimizer_tensors(self.optimizer)
        separate = [m for m, sep in zip(self._masters, self._separate) if sep]
        if self.location == "host":
            return {"optimizer_state": Held(host=state), "master_weights": Held(host=separate)}
        return {"optimizer_state": Held(device=state), "master_weights": Held(device=separate)}

    def buffer_bytes(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        return None
