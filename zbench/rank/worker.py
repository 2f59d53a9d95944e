"""What runs on every rank of a case: build, wrap, train, measure, hand the results back.

Started by torch's elastic agent (``zbench.launch.elastic``) as ``python -m
zbench.worker WORKDIR`` or forked from the fork server as :func:`forked`
(``zbench.launch.forkserver``), with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, or by
``srun`` (``zbench.launch.slurm``) with SLURM's variables and ``ZBENCH_STORE``. It
reads its ``WorkerTask`` from WORKDIR and hands back a ``RankResult`` (or a
``RankError``); ``zbench.launch.handoff`` names every file.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import inspect
import os
import signal
import sys
import traceback
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from zbench.atomic import atomic_torch_save, atomic_write_bytes, atomic_write_json
from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.model_source import ModelInfo, model_info
from zbench.launch.handoff import CaseFiles, CollectiveEntry, ProbeResult, RankError, RankResult, WorkerTask
from zbench.measure import comms
from zbench.measure.bandwidth import probe_bus_bandwidth
from zbench.measure.memory import peak_memory, reset_peak
from zbench.measure.nvml import NvmlSampler
from zbench.measure.phases import PhaseClock, clock_name
from zbench.measure.profile import StepProfiler
from zbench.measure.timing import timed
from zbench.protocol import Engine, Implementation, ModelShape
from zbench.rank.checksum import checksum
from zbench.rank.paired import time_paired_rounds
from zbench.rank.probe import run_fp32_probe
from zbench.rank.training import build_engine, step_batches
from zbench.results.record import NvmlSummary, PairedTiming, PhaseTimes, RankMemory

#: What every rank calls itself in ``ps`` and psutil, forked or not (a forked rank's command line is the fork
#: server's).
RANK_PROCESS_NAME = "zbench-rank"


def pick_device(case: Case, local_rank: int) -> torch.device:
    if case.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def nvml_index(device: torch.device) -> int:
    """nvml numbers GPUs physically; CUDA numbers the visible ones."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and all(v.isdigit() for v in ids) and device.index < len(ids):
        return int(ids[device.index])
    return device.index


def _declared_comm(implementation: Implementation, shape: ModelShape, world: int, stage: int) -> int | None:
    """``expected_comm_elements``, also from implementations written before it took the stage (shape, world)."""
    method = implementation.expected_comm_elements
    if len(inspect.signature(method).parameters) == 2:
        return method(shape, world)  # type: ignore[call-arg]
    return method(shape, world, stage)


def expected_comm_elements(implementation: Implementation, info: ModelInfo, world: int, stage: int) -> int:
    """The implementation's own account of its traffic for this model's shape when it declares one, else the ZeRO
    formula."""
    if world == 1:
        return 0  # one rank has nothing to exchange (implementations may still call collectives: DDP does)
    declared = _declared_comm(implementation, info.shape, world, stage)
    return int(declared) if declared is not None else comms.theory_elements(info.parameters, stage)


def train(task: WorkerTask, files: CaseFiles, rank: int, world: int, device: torch.device) -> RankResult:
    case = task.case
    info = model_info(case.model)
    implementation = registry.resolve(case.implementation)
    model, engine = build_engine(case, device, task.swap_dir)
    losses: list[float] = []
    times: list[float] = []
    metrics: list[dict[str, float]] = []
    comm_steps: list[list[CollectiveEntry]] = []
    phases: list[PhaseTimes] = []
    bandwidth = probe_bus_bandwidth(device)
    clock = PhaseClock(model, device).attach()
    profiler = StepProfiler(case.profile_steps, device, files.profile(rank))
    sampler = NvmlSampler(nvml_index(device)).start() if device.type == "cuda" else None
    reset_peak(device)
    try:
        for step in range(case.steps):
            micro_batches = step_batches(case, info, step, rank=rank, world=world, device=device)
            comms.take()  # drop set-up traffic (DDP's initial broadcast, the bandwidth probe, ...)
            if sampler is not None and step == case.warmup_steps:
                sampler.mark()
            with profiler.step(step):
                loss, seconds = timed(
                    partial(clock.run, partial(engine.step, micro_batches)), device=device, barrier=dist.barrier
                )
            comm_steps.append([CollectiveEntry(**e) for e in comms.take()])
            phases.append(PhaseTimes(**clock.read()))
            losses.append(float(loss))
            times.append(seconds)
            metrics.append(engine.metrics())
            if rank == 0:
                files.progress.write_text(f"{step + 1}/{case.steps}")
            if step + 1 == case.probe_steps and not case.fp32_probe:
                keep_parameters(engine, rank, files.probe_params)  # an fp32 reference: what capped probes meet
        clock.detach()
        memory = peak_memory(device)  # before the final gather below, which is not training
        profiler.write()
        nvml = sampler.stop() if sampler else {"available": False, "reason": "CPU run"}
        state = engine.state_bytes()
        params = engine.full_parameters()
        paired = (
            time_paired_rounds(
                case,
                engine,
                info=info,
                rank=rank,
                world=world,
                device=device,
                swap_dir=task.swap_dir,
                after_step=comms.take,
            )
            if case.paired_rounds
            else PairedTiming(skipped="the suite asked for no paired rounds")
        )
    finally:
        engine.close()  # e.g. remove NVMe swap files
    if rank == 0:
        atomic_torch_save(params, files.params)
    return RankResult(
        rank=rank,
        losses=losses,
        step_times_s=times,
        metrics=metrics,
        comms=comm_steps,
        phases=phases,
        clock=clock_name(device),
        bus_bandwidth_bytes_per_s=bandwidth,
        expected_comm_elements=expected_comm_elements(implementation, info, world, case.stage),
        memory=RankMemory(**memory),
        state_bytes=state,
        nvml=NvmlSummary(**nvml),
        gpu_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        parameters=info.parameters,
        param_checksum=checksum(params),
        paired=paired,
    )


def keep_parameters(engine: Engine, rank: int, path: Path) -> None:
    """Rank 0 writes the engine's full parameters now (every rank gathers: it may be a collective)."""
    params = engine.full_parameters()
    if rank == 0:
        atomic_torch_save(params, path)


def fp32_probe(task: WorkerTask, files: CaseFiles, rank: int, world: int, device: torch.device) -> ProbeResult:
    """The case's fp32 probe (``zbench.rank.probe``); a failure in it is the case's error, said to be the probe's
    (an fp32 copy that does not fit where bf16 did: the suite's ``fp32_probe: false``)."""
    gc.collect()
    try:
        return run_fp32_probe(
            task.case,
            info=model_info(task.case.model),
            rank=rank,
            world=world,
            device=device,
            swap_dir=task.swap_dir,
            params_path=files.probe_params,
        )
    except Exception as exc:
        raise RuntimeError(f"fp32 probe: {type(exc).__name__}: {exc}") from exc


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (
        isinstance(exc, (torch.OutOfMemoryError, MemoryError))
        or "out of memory" in text
        or "can't allocate memory" in text
    )  # the CPU allocator's wording


def name_process(name: str) -> None:
    """The name ``ps``, ``top`` and psutil show for this process (Linux; at most 15 characters are kept)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_NAME = 15
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15])


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the harness dies (e.g. it is itself SIGKILLed): no orphaned ranks."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the harness died before we asked
            os._exit(1)


def exit_without_teardown() -> NoReturn:
    """Leave once the results are on disk and the process group is gone, skipping interpreter teardown.

    Note: a rank sometimes died with SIGABRT ("terminate called without an active exception", a C++
    ``std::thread`` destroyed while still joinable) after writing its results: in 1 of 12 short world-3
    runs of the engine as it was when its gloo all-gather was one async broadcast per rank
    (docs/methods.md#shutdown). The abort comes from the static destructors that run at exit, after
    ``destroy_process_group``; nothing a rank still has to do needs them, so it exits the way a forked
    child does (``os._exit``), after flushing its output.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_and_world(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from torch's launcher (``RANK`` ...) or from ``srun``."""
    if "RANK" in env:
        world = int(env["WORLD_SIZE"])
        return int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world))
    world = int(env["SLURM_NTASKS"])
    per_node = env.get("SLURM_NTASKS_PER_NODE", str(world)).split("(")[0]  # "2(x3)": 2 tasks on each of 3 nodes
    return int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), int(per_node)


def harness_store(world: int, timeout_s: float) -> dist.Store | None:
    """The store the harness hosts for the case (``ZBENCH_STORE=HOST:PORT``, under srun), else None: ``env://``."""
    address = os.environ.get("ZBENCH_STORE")
    if not address:
        return None
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world + 1, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def run(workdir: Path) -> None:
    """Everything a rank does, from reading its task to leaving the process group; exits with 3 on any failure."""
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the launcher keeps one log per rank: its stderr
    die_with_parent()
    name_process(RANK_PROCESS_NAME)
    comms.install()
    faulthandler.register(
        signal.SIGUSR1, all_threads=True
    )  # the launcher's "where are you stuck?" before a timeout kill
    files = CaseFiles(workdir)
    task = WorkerTask.model_validate_json(files.task.read_text())
    rank, world, local_rank, local_world = rank_and_world(os.environ)
    atomic_write_bytes(files.pid(rank), str(os.getpid()).encode(), durable=False)
    if task.case.device == "cpu":
        torch.set_num_threads(
            int(os.environ.get("ZBENCH_THREADS_PER_RANK", max(1, (os.cpu_count() or 1) // local_world)))
        )
    try:
        device = pick_device(task.case, local_rank)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=harness_store(world, task.case.timeout_s),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=task.case.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
        result = train(task, files, rank, world, device)
        if task.case.fp32_probe:  # after train() has returned: the case's model and engine are freed first
            result.probe = fp32_probe(task, files, rank, world, device)
    except BaseException as exc:  # recorded for the launcher, then the process dies without waiting on peers
        error = RankError(
            rank=rank,
            kind="oom" if is_oom(exc) else "error",
            message=f"{type(exc).__name__}: {exc}".strip()[:2000],
            traceback=traceback.format_exc()[-8000:],
        )
        atomic_write_json(files.error(rank), error.model_dump(mode="json"))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    atomic_write_json(files.result(rank), result.model_dump(mode="json"))
    # every rank's results are on disk before any rank tears down: the agent stops the others as soon as one
    # ends non-zero, and a rank that crashes in teardown must not cost a slower peer its results
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    """``python -m zbench.worker WORKDIR``: a rank started as a fresh interpreter."""
    run(Path(argv[0]))
    exit_without_teardown()


def forked(workdir: str, search_path: list[str]) -> int:
    """A rank forked from the fork server (``zbench.launch.forkserver``), run by the elastic agent as a function.

    This process forks once more and waits: the rank runs in its child, and this one writes how the rank ended
    (``rank<R>.exit``) when that was not a clean exit, then ends the same way. Why: for ranks it runs as functions
    the agent reports only the first rank it sees fail, and the fork server, not the harness, is their parent; so
    a rank killed by a signal (the OOM killer's SIGKILL) while its peer fails in its next collective would go
    unnamed, and the case would be blamed on the peer's "connection closed".

    Note: on success it returns rather than leaving through ``os._exit`` as a fresh rank does: the agent waits
    for each function's return value, and the process that calls it ends with ``os._exit`` anyway, so no
    interpreter teardown runs either way.
    """
    sys.path[:0] = [p for p in search_path if p not in sys.path]
    die_with_parent()
    name_process(RANK_PROCESS_NAME)
    files = CaseFiles(Path(workdir))
    child = os.fork()
    if child == 0:
        try:
            run(files.workdir)
        except BaseException:  # before run() records errors itself (an unreadable task)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return 0
    rank = rank_and_world(os.environ)[0]
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    atomic_write_bytes(files.exit_code(rank), str(code).encode(), durable=False)
    if code < 0:  # end as the rank did, so that the agent sees the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code > 0 else 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
