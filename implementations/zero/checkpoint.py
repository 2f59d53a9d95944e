"""Sharded checkpoints: a directory with one file per rank, each holding only that rank's state."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from zbench.implementations.zero.comm import Comm
from zbench.implementations.zero.flat import FlatLayout

FORMAT = 1


def shard_path(path: str | os.PathLike, rank: int) -> Path:
    return Path(path) / f"rank{rank:05d}.pt"


def save(path: str | os.PathLike, state: dict, *, comm: Comm, stage: int, layouts: Sequence[FlatLayout]) -> None:
    """Write this rank's ``state`` (atomically), then wait until every rank has written its own."""
    target = shard_path(path, comm.rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "stage": stage,
        "world": comm.world,
        "rank": comm.rank,
        "numels": [layout.numel for layout in layouts],
        "state": state,
    }
    tmp = target.with_name(target.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, target)
    comm.barrier()


def load(
    path: str | os.PathLike, *, comm: Comm, stage: int, layouts: Sequence[FlatLayout], device: torch.device
) -> dict:
    """This rank's state from a checkpoint written by the same stage at the same world size."""
    source = shard_path(path, comm.rank)
    if not source.is_file():
        raise FileNotFoundError(f"no checkpoint shard for rank {comm.rank} at {source}")
    payload = torch.load(source, map_location=device, weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{source}: checkpoint format {payload.get('format')!r}, expected {FORMAT}")
    expected = {"stage": stage, "world": comm.world, "rank": comm.rank, "numels": [layout.numel for layout in layouts]}
    for key, value in expected.items():
        if payload[key] != value:
            raise ValueError(
                f"{source}: checkpoint {key} is {payload[key]!r}, this engine has {value!r} "
                "(resume with the same stage, world size and model)"
            )
    return payload["state"]
