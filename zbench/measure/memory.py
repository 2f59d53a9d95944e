"""Peak memory per rank: the CUDA allocator's peak on GPU, the process's peak resident set on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (includes the interpreter and torch itself)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory(device: torch.device) -> dict[str, int | str]:
    """This rank's peak memory; ``bytes`` is the figure reports compare, ``kind`` says what it is."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"kind": "cuda_allocated", "bytes": torch.cuda.max_memory_allocated(device),
                "cuda_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0),
                "rss_bytes": peak_rss_bytes()}
    return {"kind": "rss", "bytes": peak_rss_bytes()}
