"""Peak memory per rank over the training steps: the CUDA allocator's peak on GPU, the resident set's on CPU.

The peak is reset just before the first step, so building the model, sharding
it and gathering the final parameters for the equivalence check (rank 0 holds a
full fp32 copy then) do not count: what is compared is what training holds.
On Linux the resident peak is reset through ``/proc/self/clear_refs`` and read
back as ``VmHWM``; where that is not possible the figure is the process's
lifetime peak (``ru_maxrss``) and says so.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

#: glibc's initial mmap threshold (128 KiB), pinned for CPU ranks (``zbench.launch.elastic``; a value the user
#: exports is kept). By default glibc raises the threshold as large blocks are freed, after which backward's freed
#: transients stay in the heap, resident: peak RSS then measured glibc's free lists (150-290 MiB on the
#: 41M-parameter model, different every run) rather than what the rank held, and hid what NVMe offload takes out
#: of memory. Pinned, large blocks are mapped and unmapped and RSS follows the bytes in use.
#: The price is time: every tensor of 128 KiB or more a CPU rank creates is mapped, faulted in page by page and
#: unmapped when freed (the `small` GPT's DDP step at world 1: 65 ms without, 108 ms with, 2026-11-27, 2-core
#: CPU); ``zbench calibrate`` measures that rate (``mapped_gb_s``) so the simulator charges it.
CPU_MMAP_THRESHOLD_BYTES = 131072
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(CPU_MMAP_THRESHOLD_BYTES)}

_rss_reset = False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since ``reset_peak`` (or since it started)."""
    if _rss_reset:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak(device: torch.device) -> None:
    """Start the peak over from what is held now."""
    global _rss_reset
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (Linux >= 4.0)
        _rss_reset = True
    except OSError:
        _rss_reset = False


def peak_memory(device: torch.device) -> dict[str, int | str | bool]:
    """This rank's peak memory; ``bytes`` is the figure reports compare, ``kind`` says what it is."""
    rss = {"rss_bytes": peak_rss_bytes(), "since": "first step" if _rss_reset else "process start"}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "kind": "cuda_allocated",
            "bytes": torch.cuda.max_memory_allocated(device),
            "cuda_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0),
            **rss,
        }
    return {"kind": "rss", "bytes": rss["rss_bytes"], **rss}


def free_bytes(device: torch.device) -> int:
    """Memory this rank could still allocate: the GPU's free memory, or the host's available memory per local rank."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return psutil.virtual_memory().available // max(1, local_ranks)
