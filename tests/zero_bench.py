"""Step time of the zero engines against DDP, interleaved in one process group: ``python tests/zero_bench.py``.

Every rank builds DDP, zero1, zero2 and zero3 on identical models and, step after step, times
one step of each in turn (rotating which goes first), between barriers, with perf_counter; warm-up
steps are dropped. Prints each implementation's median step time, the ratio of its median to DDP's,
and the median over steps of the paired ratio (its step time over DDP's in the same step, which
cancels load that changes more slowly than one round of steps; on a shared machine trust that one).
Defaults: world 2 on CPU (gloo), the ``small`` preset, micro-batch 4 per rank, AdamW, fp32, one
thread per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMPLS = ("ddp", "zero1", "zero2", "zero3")


def rank_main(rank: int, args: argparse.Namespace, store: str) -> None:
    from zbench import registry
    from zbench.models import build_model, get_config, rank_micro_batches, synthetic_batch
    from zbench.protocol import TrainSpec

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=300))
    options = json.loads(args.options)
    runs = {name: (name, options.get(name, {}) if name != "ddp" else {}) for name in args.impls}
    for variant in args.variant:  # LABEL=IMPL:JSON
        label, _, rest = variant.partition("=")
        impl, _, opts = rest.partition(":")
        runs[label] = (impl, json.loads(opts or "{}"))
    engines = {}
    for label, (impl, opts) in runs.items():
        spec = TrainSpec(device=torch.device("cpu"), precision=args.precision, lr=1e-3, options=opts)
        engines[label] = registry.resolve(impl).build(build_model(args.model, seed=0), spec, dist.group.WORLD)
    cfg = get_config(args.model)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.warmup + args.steps):
        batch = synthetic_batch(cfg, seed=0, step=step, rows=args.micro_batch * args.world)
        micro_batches = rank_micro_batches(batch, rank=rank, world=args.world, grad_accum=1)
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            engines[name].step(micro_batches)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        ref = statistics.median(times["ddp"]) if "ddp" in times else None
        print(f"{args.model}, world {args.world}, micro-batch {args.micro_batch}, {args.precision}, "
              f"{args.threads} thread(s)/rank, {args.steps} timed steps after {args.warmup} warm-up, "
              f"load average {os.getloadavg()[0]:.2f}")
        for name in names:
            med = statistics.median(times[name])
            q1, _, q3 = statistics.quantiles(times[name], n=4)
            line = f"  {name:12s} median {med * 1e3:7.1f} ms  (IQR {q1 * 1e3:.1f}-{q3 * 1e3:.1f})"
            if ref:
                paired = statistics.median(t / d for t, d in zip(times[name], times["ddp"]))
                line += f"  median/ddp {med / ref:.3f}  paired {paired:.3f}"
            print(line)
    engines.clear()  # drop engines (and their collectives' buffers) before the group goes away
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS))
    parser.add_argument("--options", default="{}", help='zero options by name, JSON: \'{"zero2": {"bucket_mb": 8}}\'')
    parser.add_argument("--variant", action="append", default=[],
                        help='another engine to time, LABEL=IMPL:JSON_OPTIONS, '
                             'e.g. \'z2-16mb=zero2:{"bucket_mb": 16}\'')
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "store")), nprocs=args.world)


if __name__ == "__main__":
    main()
