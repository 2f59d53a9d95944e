"""What the harness sees: versions, backends, GPUs and driver. Stored in every run.json and shown by ``zbench env``."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import zbench


def git_sha(cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def nvml_info() -> dict:
    """Driver version and GPU names from nvml, or why nvml is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver, no GPU: all mean "unavailable"
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    try:
        count = pynvml.nvmlDeviceGetCount()
        gpus = []
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "memory_total_bytes": mem.total})
        return {"available": True, "driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": gpus}
    finally:
        pynvml.nvmlShutdown()


def nvlink_links_up() -> list[int]:
    """NVLink links up on each GPU (nvml), empty where nvml or NVLink is absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU
        return []
    try:
        counts = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle, up = pynvml.nvmlDeviceGetHandleByIndex(i), 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    up += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:  # past the GPU's last link, or no NVLink at all
                    break
            counts.append(up)
        return counts
    finally:
        pynvml.nvmlShutdown()


def interconnect() -> dict:
    """What NCCL would talk over: NVLink between local GPUs, InfiniBand devices, and the NCCL settings given."""
    ib = Path("/sys/class/infiniband")
    return {
        "nvlink_links_up": nvlink_links_up(),
        "infiniband": sorted(p.name for p in ib.iterdir()) if ib.is_dir() else [],
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
    }


def collect() -> dict:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    info = {
        "zbench_version": zbench.__version__,
        "git_sha": git_sha(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "nvml": nvml_info(),
        "interconnect": interconnect(),
    }
    if cuda and dist.is_nccl_available():
        info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info
