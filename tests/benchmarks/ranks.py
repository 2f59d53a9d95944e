"""The benchmarks' one rank launcher: run a function on N CPU ranks (gloo) and return rank 0's result.

Benchmarks time engines against each other inside one process group, so they start ranks
themselves rather than going through ``zbench run`` (a process group per case, instruments
always on). This module is the only place in ``tests/benchmarks`` that does, so every
benchmark pays the same set-up: spawned processes (no state inherited from pytest), a fixed
number of torch threads per rank, and a group on a free local port.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zbench.ports import free_port

RankFn = Callable[..., Any]
"""``fn(rank, world, *args)``, module-level (spawn pickles it by name); rank 0's return value must be JSON-able."""


def _rank(rank: int, world: int, port: int, threads: int, out: str, fn: RankFn, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()


def run_ranks(fn: RankFn, *args: Any, world: int = 2, threads: int = 1) -> Any:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks in one gloo group; return what rank 0 returned.

    A rank that raises makes this raise (``torch.multiprocessing.ProcessRaisedException``) with its traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(world, free_port(), threads, out, fn, args), nprocs=world, start_method="spawn")
        with open(out) as f:
            return json.load(f)
