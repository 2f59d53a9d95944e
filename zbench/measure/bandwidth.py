"""The process group's bus bandwidth, probed once per case, so communication volume can be turned into time.

Collectives run asynchronously on the backend's own threads or streams, so
timing each one inside a step would either perturb the step (synchronising) or
be wrong (NCCL work completes on a stream the host does not see). Instead each
rank measures, before training, how fast the group moves an all-reduce of a
realistic size; a step's logical volume (the ledger's elements × bytes) divided
by that rate is the time the step's communication would take if nothing hid
it. Over the step's forward + backward time that is the communication-to-compute
ratio: below 1 the traffic can in principle be overlapped, above 1 it cannot.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from zbench.measure.timing import synchronize

#: Probe size in bytes: large enough to reach the link's rate, small enough to cost well under a second.
PROBE_BYTES = {"cuda": 256 * 2**20, "cpu": 16 * 2**20}


def probe_bus_bandwidth(device: torch.device, *, repeats: int = 5) -> float | None:
    """Logical bytes per second of an all-reduce over the default group (``None`` at world 1).

    Logical bytes follow the ledger's convention (an all-reduce of n bytes moves 2n), so that
    ``ledger bytes / this rate`` is a time.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    n = PROBE_BYTES.get(device.type, PROBE_BYTES["cpu"]) // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        synchronize(device)
        if i >= 2:  # the first two set up connections and buffers
            times.append(time.perf_counter() - start)
    return 2 * n * 4 / statistics.median(times)
