"""A cluster profile of this machine for ``zbench plan --simulate``: each CPU rank (one core) as a "GPU".

Measures what the profile needs, on the machine it runs on, and prints the YAML
(``--out`` writes it; the built-in ``cpu-2core`` profile was made this way):

- peak: an fp32 1024 x 1024 matrix product on one thread (each rank of a CPU run gets one core);
- efficiency: the model TFLOP/s a real ``zbench run`` of ``small`` with DDP at world 2 reached, over that peak;
- link: the run's own bus-bandwidth probe (gloo over loopback) and the median time of a one-element
  all-reduce between two processes (a tree of 2 ranks: two hops, so half of it per hop);
- "PCIe": a single-threaded host memory copy; "NVMe": writing a file with fsync, the slower direction;
- host optimizer: torch's AdamW (for-loop) step on one thread, parameters per second.

``python -m tests.benchmarks.cpu_profile --out zbench/plan/simulate/clusters/cpu-2core.yaml`` (about 2 minutes).
The machine's speed drifts (up to 3x between minutes on a shared host), so the figures are one sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zbench.ports import free_port

SUITE = """
name: cpu-profile
device: cpu
models: small
implementations: [ddp]
world_sizes: 2
precisions: [fp32]
steps: 10
warmup_steps: 2
micro_batch: 4
paired_rounds: 0
timeout_s: 600
"""


def _median_seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_tflops() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    return 2 * 1024**3 / _median_seconds(lambda: a @ b, 20) / 1e12


def copy_gb_s() -> float:
    src, dst = torch.ones(64 * 2**20 // 4), torch.empty(64 * 2**20 // 4)
    return 64 * 2**20 / _median_seconds(lambda: dst.copy_(src), 10) / 1e9


def disk_write_gb_s(directory: Path) -> float:
    data = os.urandom(256 * 2**20)

    def write() -> None:
        with open(directory / "probe.bin", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return len(data) / _median_seconds(write, 3) / 1e9


def adam_params_per_s() -> float:
    p = torch.nn.Parameter(torch.randn(4 * 2**20))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], foreach=False)
    opt.step()
    return p.numel() / _median_seconds(opt.step, 5)


def _latency_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(1)
    for _ in range(20):
        dist.all_reduce(x)
    seconds = _median_seconds(lambda: dist.all_reduce(x), 200)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def small_all_reduce_s(tmp: Path) -> float:
    mp.spawn(_latency_rank, args=(free_port(), str(tmp / "latency.json")), nprocs=2)
    return float(json.loads((tmp / "latency.json").read_text()))


def ddp_run(tmp: Path) -> dict:
    (tmp / "suite.yaml").write_text(SUITE)
    subprocess.run([sys.executable, "-m", "zbench", "run", str(tmp / "suite.yaml"), "--results", str(tmp / "r"),
                    "--report", str(tmp / "rep")], check=True)  # fmt: skip
    (run,) = (tmp / "r").iterdir()
    return json.loads((run / "cases" / "small-ddp-s0-w2-fp32-none.json").read_text())  # not its noise twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = psutil.cpu_count(logical=True) or 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        peak = matmul_tflops()
        record = ddp_run(tmp)
        achieved = record["throughput"]["tflops_per_rank"]
        bandwidth = record["comms"]["bus_bandwidth_bytes_per_s"] / 1e9
        hop_us = small_all_reduce_s(tmp) / 2 * 1e6
        pcie, nvme, adam = copy_gb_s(), disk_write_gb_s(tmp), adam_params_per_s()
    memory_gib = psutil.virtual_memory().total / 2**30 / cores
    today = datetime.date.today().isoformat()
    yaml_text = f"""\
# This machine as a cluster: each of its {cores} cores is one rank ("GPU") of one node, gloo over loopback.
# Measured {today} by tests/benchmarks/cpu_profile.py (one sample; a shared host drifts up to 3x):
# fp32 1024^2 matmul on one thread, efficiency = model TFLOP/s of `small` DDP at world 2 / that peak,
# link = that run's bus-bandwidth probe and half a one-element all-reduce between two processes,
# "PCIe" = a host memory copy, "NVMe" = file writes with fsync, host Adam = torch AdamW on one thread.
name: cpu-{cores}core
description: this machine, {cores} CPU cores as {cores} ranks, gloo over loopback
gpu: CPU core (fp32)
peak_tflops: {peak:.4f}
memory_gib: {memory_gib:.1f}
efficiency: {min(1.0, achieved / peak):.2f}
gpus_per_node: {cores}
intra_node: {{bandwidth_gb_s: {bandwidth:.2f}, latency_us: {hop_us:.0f}}}
inter_node: {{bandwidth_gb_s: {bandwidth:.2f}, latency_us: {hop_us:.0f}}}
pcie_gb_s: {pcie:.1f}
nvme_gb_s_per_node: {nvme:.2f}
host_adam_params_per_s: {adam:.3g}
overlap: 0.0             # gloo beside compute on shared cores hides nothing (docs/methods.md#simulation)
"""
    print(yaml_text)
    if args.out:
        args.out.write_text(yaml_text)


if __name__ == "__main__":
    main()
