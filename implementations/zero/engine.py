"""What every stage's engine answers the same way: full parameters, metrics, sharded checkpoints, closing."""

from __future__ import annotations

import os
from collections import deque

import torch

from implementations.zero import checkpoint
from implementations.zero.state import gather_full_parameters


GATHERS_IN_FLIGHT = 2


class ShardedEngine:
    """Shared tail of ``ZeRO1Engine``, ``ZeRO2Engine`` and ``ZeRO3Engine``.

    A subclass sets ``stage``, ``spec``, ``comm``, ``names``, ``placement``, ``optimizer`` and
    ``scaler`` and says which flat parameter groups it holds (``flat_groups``).
    """

    stage: int

    def flat_groups(self) -> list:
        return self.groups

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return gather_full_parameters([g.layout for g in self.flat_groups()], self.optimizer.masters.masters(),
                                      comm=self.comm, order=self.names, device=self.spec.device)

    def metrics(self) -> dict[str, float]:
        return {**self.scaler.metrics(), **self.optimizer.metrics()}

    def save(self, path: str | os.PathLike) -> None:
        """A sharded checkpoint; offloaded state is read back (from the host or from disk) into it."""
        checkpoint.save(path, self.optimizer.state_dict(), comm=self.comm, stage=self.stage,
                        layouts=[g.layout for g in self.flat_groups()])

    def load(self, path: str | os.PathLike) -> None:
        """Resume from ``save``'s checkpoint under any offload mode; state goes where this engine keeps it."""
        state = checkpoint.load(path, comm=self.comm, stage=self.stage,
                                layouts=[g.layout for g in self.flat_groups()], device=self.optimizer.masters.home)
        self.optimizer.load_state_dict(state)
        self.refresh_parameters()

    def refresh_parameters(self) -> None:
        """Stages 1 and 2 hold full parameters: all-gather them from the updated shards (after a step or a load).

        Note: at most ``GATHERS_IN_FLIGHT`` gathers are outstanding. gloo allocates an all-gather's
        receive buffer when the collective is enqueued, so starting every group's gather at once
        held a second, transient copy of the whole model (and left it resident as heap
        fragmentation); gloo runs two collectives at a time anyway, and on NCCL ``wait`` does not
        block the host, so nothing is lost.
        """
        inflight: deque = deque()
        for group in self.flat_groups():
            inflight.append(group.all_gather(async_op=True))
            if len(inflight) > GATHERS_IN_FLIGHT:
                inflight.popleft().wait()
        while inflight:
            inflight.popleft().wait()

    def close(self) -> None:
        """Release what outlives the engine's tensors: with ``nvme``, finish I/O and remove this rank's swap files.

        Idempotent; the engine must not be used afterwards. A no-op for the other offload modes.
        """
        self.placement.close()
