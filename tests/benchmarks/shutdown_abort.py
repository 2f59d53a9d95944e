"""The shutdown abort, reproduced without zbench: gloo ranks that exit normally sometimes die with SIGABRT.

Seen in zbench runs as "terminate called without an active exception" on a rank that had
already written its results (the zero engines, ``ZeroRedundancyOptimizer``). Each launch
starts ``--world`` ranks on gloo; every rank runs a few rounds of the all-gather our engine
once used (one in-place async broadcast per rank, all in flight together), waits for all of
them, destroys the process group and leaves:

- ``--exit normal``: returns from ``main`` (the interpreter's teardown runs: atexit hooks,
  module and C++ static destructors);
- ``--exit os_exit``: flushes and calls ``os._exit(0)`` after ``destroy_process_group``,
  what zbench's worker does (``zbench.worker.exit_without_teardown``).

It prints how many of ``--launches`` groups had a rank killed by a signal, and by which:
``python -m tests.benchmarks.shutdown_abort --launches 30 --exit normal``.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from collections import Counter

from zbench.ports import free_port

RANK_PROGRAM = r"""
import os, sys, torch, torch.distributed as dist
rank, world, port, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
flat = torch.full((world * 200_000,), float(rank))
for _ in range(20):
    chunks = flat.view(world, -1)
    works = [dist.broadcast(chunks[r], src=r, async_op=True) for r in range(world)]
    for w in works:
        w.wait()
dist.destroy_process_group()
if how == "os_exit":
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
"""


def launch(world: int, how: str) -> list[int]:
    """One group; every rank's exit code (negative: killed by that signal)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_PROGRAM, str(r), str(world), port, how],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(world)
    ]
    codes = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        if p.returncode != 0:
            sys.stderr.write(err.decode(errors="replace")[-300:])
        codes.append(p.returncode)
    return codes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--exit", choices=("normal", "os_exit"), default="normal")
    args = parser.parse_args()
    bad: Counter[str] = Counter()
    for i in range(args.launches):
        codes = launch(args.world, args.exit)
        for c in codes:
            if c != 0:
                bad[signal.Signals(-c).name if c < 0 else f"exit {c}"] += 1
        failed = any(c != 0 for c in codes)
        print(f"[{i + 1}/{args.launches}] {'ABORTED ' + str(codes) if failed else 'ok'}", flush=True)
    groups = sum(bad.values())
    print(f"{args.exit}: {groups} rank exits not clean in {args.launches} launches at world {args.world}: {dict(bad)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
