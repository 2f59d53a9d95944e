"""Model FLOPs, achieved TFLOP/s and MFU (docs/methods.md): 6·(Ψ − embeddings) + attention FLOPs per token.

Peak throughput is looked up by GPU name (dense bf16/fp16 tensor-core figures)
and can be overridden with ``ZBENCH_PEAK_TFLOPS``. fp32 runs are measured
against the GPU's plain FP32 peak, not TF32's: zbench leaves torch's default
``float32_matmul_precision("highest")``, so fp32 matrix products do not use
TF32 tensor cores (the H100 ran GPT-125M fp32 at 42 TFLOP/s, 8% of TF32's
494 but 63% of FP32's 67).
On a CPU there is no meaningful peak: MFU is left out and only TFLOP/s is given.
"""

from __future__ import annotations

import os
from typing import Protocol

#: name fragment -> (dense bf16/fp16 tensor-core TFLOP/s, FP32 TFLOP/s); SXM figures for H100/H200/A100
PEAK_TFLOPS = {
    "H200": (989.0, 67.0),
    "H100": (989.0, 67.0),
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "A10G": (125.0, 31.2),
    "L4": (121.0, 30.3),
    "V100": (125.0, 15.7),
}


def peak_tflops(gpu_name: str | None, precision: str) -> float | None:
    override = os.environ.get("ZBENCH_PEAK_TFLOPS")
    if override:
        return float(override)
    if not gpu_name:
        return None
    for fragment, (low, fp32) in PEAK_TFLOPS.items():
        if fragment in gpu_name:
            return fp32 if precision == "fp32" else low
    return None


class FlopsCounter(Protocol):
    """A preset's ``GPTConfig`` or a user model's ``ModelInfo``: what one token of training costs."""

    def flops_per_token(self, seq: int | None = None) -> float: ...


def derived(
    cfg: FlopsCounter,
    *,
    seq: int,
    tokens_per_step: int,
    step_time_s: float,
    world: int,
    precision: str,
    gpu_name: str | None,
) -> dict[str, float | None]:
    """Achieved model TFLOP/s per rank and, where the peak is known, MFU, for sequences of ``seq`` tokens."""
    flops_per_token = cfg.flops_per_token(seq)
    tflops_per_rank = flops_per_token * tokens_per_step / step_time_s / world / 1e12
    peak = peak_tflops(gpu_name, precision)
    return {
        "model_flops_per_token": flops_per_token,
        "tflops_per_rank": tflops_per_rank,
        "peak_tflops": peak,
        "mfu": tflops_per_rank / peak if peak else None,
    }
