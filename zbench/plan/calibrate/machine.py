"""One calibration of the machine at hand: every probe in turn, with a progress line each, into a
:class:`Calibration`.

On a GPU (``torch.cuda`` sees one) the probes run on ``cuda:0`` timed with CUDA events and the collectives
over NCCL, one rank per GPU; elsewhere on the CPU, one thread per rank as a CPU run of zbench gives each rank
one core, with the collectives over gloo.
"""

from __future__ import annotations

import datetime
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

import zbench
from zbench.plan.calibrate import collectives, in_step, kernels, overheads
from zbench.plan.calibrate.disk import probe_disk
from zbench.plan.calibrate.timer import Timer
from zbench.plan.simulate.calibration import Calibration, DiskProbe


@dataclass(frozen=True)
class Machine:
    """What is calibrated: the device, how many ranks share the host, and its name and memory per rank."""

    device: torch.device
    ranks: int
    name: str
    memory_gib: float
    per_node: int
    """GPUs in this node (every visible one, however many were measured); on a CPU the ranks measured."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @staticmethod
    def here(ranks: int | None) -> Machine:
        """The GPUs torch sees (``ranks`` of them, default all), else ``ranks`` CPU cores (default all, at most 4)."""
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(0)
            return Machine(
                torch.device("cuda", 0), min(ranks or count, count), props.name, props.total_memory / 2**30, count
            )
        n = ranks or min(kernels.cores(), 4)
        return Machine(torch.device("cpu"), n, "CPU core (fp32)", psutil.virtual_memory().total / 2**30 / n, n)


def calibrate(
    machine: Machine,
    *,
    disk_dir: Path | None,
    quick: bool,
    progress: Callable[[str], None],
    also_ranks: tuple[int, ...] = (),
) -> Calibration:
    """Every probe in turn; ``also_ranks``: the collectives measured over these rank counts too."""
    started = time.perf_counter()
    threads = 1 if machine.device.type == "cpu" else max(1, kernels.cores() // machine.ranks)
    torch.set_num_threads(1 if machine.device.type == "cpu" else threads)
    timer = Timer(machine.device, budget_s=0.1 if quick else 0.3)
    sizes = kernels.Sizes.for_device(machine.device, quick=quick)
    steps = 6 if disk_dir is not None else 5

    def step(i: int, what: str) -> None:
        progress(f"[{i}/{steps}] {what} ({time.perf_counter() - started:.0f} s so far)")

    def detail(what: str) -> None:
        progress(f"      {what} ({time.perf_counter() - started:.0f} s so far)")

    step(1, f"matrix products on {machine.device.type}: {', '.join(map(kernels.dtype_name, sizes.dtypes))}")
    matmul = kernels.matmul_table(timer, sizes)
    on_cpu = machine.device.type == "cpu"
    rank_work = (", a rank's fresh pages, threads, operators inside a training step and each implementation's host "
                 "work") if on_cpu else ""  # fmt: skip
    step(2, f"memory-bound operators, host <-> device copies{rank_work}")
    memory_bound = kernels.memory_bound(timer, sizes)
    copies = kernels.copies(timer, sizes, memory_bound)
    rank = kernels.rank_probes(quick, progress=detail) if on_cpu else {}
    step(3, "per-operator cost inside a training step, module hooks, the host optimizer step")
    hook_us, op_us, adam = kernels.hook_call_us(), kernels.op_call_us(timer), kernels.host_adam_params_per_s(threads)
    curves: list = []
    issue_s = None
    if machine.ranks > 1:
        step(4, f"collectives over {machine.ranks} {machine.backend} ranks (spawning them)")
        curves, issue_s = collectives.measure(machine.ranks, machine.backend, quick=quick, on_retry=detail)
        for ranks in also_ranks:
            detail(f"and over {ranks} ranks")
            curves += collectives.measure(ranks, machine.backend, quick=quick, on_retry=detail)[0]
    else:
        step(4, "collectives: skipped, one rank")
    disk: DiskProbe | None = None
    if disk_dir is not None:
        step(5, f"disk: write and read in {disk_dir}")
        disk = probe_disk(disk_dir, 64 * 2**20 if quick else 256 * 2**20)
    step(steps, "done")
    cal = Calibration(
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=platform.node(),
        torch=torch.__version__,
        zbench=zbench.__version__,
        device=machine.name if machine.device.type == "cuda" else "cpu",
        backend=machine.backend,
        ranks=machine.ranks,
        threads_per_rank=threads,
        seconds=round(time.perf_counter() - started, 1),
        matmul=matmul,
        memory_bound=memory_bound,
        collectives=curves,
        collective_issue_us=None if issue_s is None else issue_s * 1e6,
        hook_call_us=hook_us,
        op_call_us=op_us,
        copies_gb_s=copies,
        disk=disk,
        host_adam_params_per_s=adam,
        mapped_gb_s=rank.get("mapped_gb_s"),
    )
    if "in_step" in rank:  # before the residuals, which are taken against the operators' factored costs
        cal = cal.model_copy(update={"operator_factors": in_step.factors(rank["in_step"], cal)})
        cal = cal.model_copy(update={"step_residuals": in_step.step_residuals(rank["in_step"], cal),
                                     "thread_speedups": in_step.thread_speedups(rank["in_step"], cal),
                                     "corun_slowdowns": in_step.corun_slowdowns(rank["in_step"], cal)})  # fmt: skip
    if "overheads" in rank:  # residuals against the operator costs just measured
        cal = cal.model_copy(update={"overheads": overheads.fit(rank["overheads"], cal)})
    return cal
