"""How much do zbench's instruments cost? The anchor workload, bare and fully instrumented, interleaved.

Two ranks (gloo) train the ``small`` GPT with DDP (micro-batch 4, AdamW, fp32)
in alternating blocks of steps: *bare* (``engine.step`` and nothing else) and
*instrumented* (everything the worker does per step: the communication ledger,
barrier-bracketed timing, the forward/backward/optimizer phase clock, ledger
snapshots, metrics). Interleaving cancels
drift. Overhead is the median instrumented block time over the median bare one,
minus one.

Run it: ``python -m zbench.measure.overhead`` (or the pytest-benchmark in
``tests/benchmarks``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zbench.measure import comms
from zbench.measure.phases import PhaseClock
from zbench.measure.timing import timed


def _rank(rank: int, world: int, port: int, rounds: int, block: int, model: str, out: str) -> None:
    from zbench.implementations.ddp import DDP
    from zbench.models import build_model, get_config, rank_micro_batches, synthetic_batch
    from zbench.protocol import TrainSpec

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cpu")
    module = build_model(model, seed=0)
    engine = DDP().build(module, TrainSpec(device=device), dist.group.WORLD)
    clock = PhaseClock(module, device)
    cfg = get_config(model)
    batches = [rank_micro_batches(synthetic_batch(cfg, seed=0, step=i, rows=4 * world), rank=rank, world=world,
                                  grad_accum=1) for i in range(block)]

    def bare() -> None:
        for mbs in batches:
            float(engine.step(mbs))

    def instrumented() -> None:
        for mbs in batches:
            comms.take()
            loss, _ = timed(lambda: clock.run(lambda: engine.step(mbs)), device=device, barrier=dist.barrier)
            comms.take()
            clock.read()
            float(loss)
            getattr(engine, "metrics", dict)()

    bare()  # warm-up
    times = {"bare": [], "instrumented": []}
    for r in range(rounds):
        for mode in (("bare", "instrumented") if r % 2 == 0 else ("instrumented", "bare")):
            if mode == "instrumented":
                comms.install()
                clock.attach()
            else:
                comms.uninstall()
                clock.detach()
            dist.barrier()
            start = time.perf_counter()
            (instrumented if mode == "instrumented" else bare)()
            dist.barrier()
            times[mode].append((time.perf_counter() - start) / block)
    comms.uninstall()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def measure(*, rounds: int = 8, block: int = 10, model: str = "small", world: int = 2) -> dict:
    """Median per-step time bare and instrumented, and the overhead in percent."""
    from zbench.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(world, free_port(), rounds, block, model, out), nprocs=world,
                           start_method="spawn")
        with open(out) as f:
            times = json.load(f)
    bare, inst = statistics.median(times["bare"]), statistics.median(times["instrumented"])
    return {"bare_step_s": bare, "instrumented_step_s": inst, "overhead_pct": (inst / bare - 1) * 100,
            "samples": times, "model": model, "world": world, "rounds": rounds, "block": block}


if __name__ == "__main__":
    result = measure()
    print(f"bare {result['bare_step_s'] * 1e3:.2f} ms/step, instrumented {result['instrumented_step_s'] * 1e3:.2f} ms/step, "
          f"overhead {result['overhead_pct']:+.2f}%")
    sys.exit(0)
