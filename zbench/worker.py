"""What runs on every rank of a case: build, wrap, train, measure, hand the results back.

Launched by ``zbench.launch`` as ``python -m zbench.worker CASE_JSON WORKDIR``
with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set. Each rank writes ``rank<R>.json`` (or
``rank<R>.error.json``) into WORKDIR; rank 0 also writes ``params.pt`` (the
final parameters) and ``progress`` (the step it is on).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from zbench import registry
from zbench.measure import comms
from zbench.measure.bandwidth import probe_bus_bandwidth
from zbench.measure.memory import peak_memory, reset_peak
from zbench.measure.nvml import NvmlSampler
from zbench.measure.phases import PhaseClock, clock_name
from zbench.measure.timing import timed
from zbench.models import build_model, get_config, rank_micro_batches, synthetic_batch
from zbench.protocol import TrainSpec
from zbench.store import atomic_write_json, atomic_torch_save


def train_spec(case: dict, device: torch.device) -> TrainSpec:
    return TrainSpec(device=device, precision=case["precision"], optimizer=case["optimizer"], lr=case["lr"],
                     weight_decay=case["weight_decay"], momentum=case["momentum"], grad_clip=case["grad_clip"],
                     grad_accum=case["grad_accum"], stage=case["stage"], offload=case["offload"],
                     nvme_dir=case["nvme_dir"], options=case["options"])


def pick_device(case: dict, local_rank: int) -> torch.device:
    if case["device"] == "cuda":
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


def expected_comm_elements(implementation, cfg, world: int, stage: int) -> int:
    """The implementation's own account of its traffic when it declares one, else the design's formula."""
    if world == 1:
        return 0  # one rank has nothing to exchange (implementations may still call collectives: DDP does)
    declared = getattr(implementation, "expected_comm_elements", None)
    return int(declared(cfg, world)) if callable(declared) else comms.theory_elements(cfg.num_parameters, stage)


def train(case: dict, workdir: Path, rank: int, world: int, device: torch.device) -> dict:
    cfg = get_config(case["model"])
    data_cfg = dataclasses.replace(cfg, seq=case["seq_len"])
    implementation = registry.resolve(case["implementation"])
    model = build_model(case["model"], seed=case["seed"], device=device)
    engine = implementation.build(model, train_spec(case, device), dist.group.WORLD)
    rows = case["micro_batch"] * case["grad_accum"] * world
    losses, times, metrics, comm_steps, phases = [], [], [], [], []
    bandwidth = probe_bus_bandwidth(device)
    clock = PhaseClock(model, device).attach()
    sampler = NvmlSampler(nvml_index(device)).start() if device.type == "cuda" else None
    reset_peak(device)
    try:
        for step in range(case["steps"]):
            batch = synthetic_batch(data_cfg, seed=case["seed"], step=step, rows=rows)
            micro_batches = rank_micro_batches(batch, rank=rank, world=world, grad_accum=case["grad_accum"],
                                               device=device)
            comms.take()  # drop set-up traffic (DDP's initial broadcast, the bandwidth probe, ...)
            if sampler is not None and step == case["warmup_steps"]:
                sampler.mark()
            loss, seconds = timed(lambda: clock.run(lambda: engine.step(micro_batches)), device=device,
                                  barrier=dist.barrier)
            comm_steps.append(comms.take())
            phases.append(clock.read())
            losses.append(float(loss))
            times.append(seconds)
            metrics.append(engine.metrics() if hasattr(engine, "metrics") else {})
            if rank == 0:
                (workdir / "progress").write_text(f"{step + 1}/{case['steps']}")
        clock.detach()
        memory = peak_memory(device)  # before the final gather below, which is not training
        nvml = sampler.stop() if sampler else {"available": False, "reason": "CPU run"}
        state = engine.state_bytes()
        params = engine.full_parameters()
    finally:
        close = getattr(engine, "close", None)  # e.g. remove NVMe swap files
        if callable(close):
            close()
    if rank == 0:
        atomic_torch_save(params, workdir / "params.pt")
    return {"rank": rank, "losses": losses, "step_times_s": times, "metrics": metrics, "comms": comm_steps,
            "phases": phases, "clock": clock_name(device), "bus_bandwidth_bytes_per_s": bandwidth,
            "expected_comm_elements": expected_comm_elements(implementation, cfg, world, case["stage"]),
            "memory": memory, "state_bytes": state, "nvml": nvml,
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "parameters": cfg.num_parameters}


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text)  # the CPU allocator's wording


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the harness dies (e.g. it is itself SIGKILLed): no orphaned ranks."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the harness died before we asked
            os._exit(1)


def main(argv: list[str]) -> int:
    die_with_parent()
    comms.install()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher's "where are you stuck?" before a timeout kill
    case_path, workdir = Path(argv[0]), Path(argv[1])
    case = json.loads(case_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if case["device"] == "cpu":
        torch.set_num_threads(int(os.environ.get("ZBENCH_THREADS_PER_RANK", max(1, (os.cpu_count() or 1) // world))))
    try:
        device = pick_device(case, local_rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=case["timeout_s"]),
                                device_id=device if device.type == "cuda" else None)
        result = train(case, workdir, rank, world, device)
    except BaseException as exc:  # recorded for the launcher, then the process dies without waiting on peers
        kind = "oom" if is_oom(exc) else "error"
        atomic_write_json(workdir / f"rank{rank}.error.json", {
            "rank": rank, "kind": kind, "message": f"{type(exc).__name__}: {exc}".strip()[:2000],
            "traceback": traceback.format_exc()[-8000:]})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    atomic_write_json(workdir / f"rank{rank}.json", result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
