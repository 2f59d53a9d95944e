"""The knobs a suite may set for the zero engines: ``{name: zero2, options: {bucket_mb: 8}}``.

Where model state lives (``TrainSpec.offload``) is not an option here but part of the case; see
``placement`` for what each offload mode keeps where.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from zbench.protocol import TrainSpec

_REDUCE_DTYPES = ("fp32", "compute")


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """Implementation-specific settings, read from ``TrainSpec.options``; every field has a default."""

    bucket_mb: float = 4.0
    """Stages 1 and 2: gradient bucket size in MiB (of the reduce dtype). A bucket is reduce-scattered
    the moment autograd has produced all of its gradients (stage 1: in the last micro-batch only),
    overlapping the rest of backward."""
    prefetch: int = 1
    """Stage 3: how many blocks ahead to start gathering, in forward and in backward; 0 gathers each
    block only when it is needed."""
    reduce_dtype: str = "fp32"
    """``fp32`` reduces gradients in fp32 whatever the compute dtype (as the FSDP adapter does);
    ``compute`` reduces them in the compute dtype (half the bytes in bf16/fp16, less accurate)."""
    initial_loss_scale: float = 2.0**16
    """fp16: the first loss scale (torch.amp.GradScaler's default)."""
    loss_scale_growth_interval: int = 2000
    """fp16: steps without overflow before the scale doubles (GradScaler's default)."""
    nvme_chunk_mb: float = 64.0
    """``offload: nvme``: the optimizer step streams each master shard from disk in sub-groups of this
    many MiB of fp32 master (DeepSpeed's ``sub_group_size``, counted in bytes), or fewer: a flat group
    is cut into at least eight sub-groups of at least 1 MiB (``NvmeMasters.PIECES``). Three sub-groups are
    resident at a time (one being read ahead, one stepped, one written behind), each with its
    optimizer state, so with AdamW the step holds ``3 * 3 * nvme_chunk_mb`` MiB of host buffers
    (at most 576 MiB at the default; plus the optimizer's own temporaries, about two sub-groups) however
    large the model. Smaller sub-groups hold less but pay a fixed cost per sub-group (an optimizer
    call and its I/Os): 0.34-0.45 ms each on the 2-core CPU machine, where a 256 MB shard stepped
    1.16-1.17x slower in 256 sub-groups of 1 MiB than at this default (paired, 5 rounds each, two
    runs, 2026-11-29), 11-15 s a step for gpt-70b's 35 GB shard on 8 ranks at 1 MiB. ``zbench tune`` searches
    64, 16 and 4 MiB (``TUNABLES``), the buffers counted as host memory (``NvmeMasters.buffer_bytes``)."""

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"zero option bucket_mb must be > 0, got {self.bucket_mb!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"zero option prefetch must be an integer >= 0, got {self.prefetch!r}")
        if self.reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(f"zero option reduce_dtype must be one of {_REDUCE_DTYPES}, got {self.reduce_dtype!r}")
        if not self.initial_loss_scale > 0:
            raise ValueError(f"zero option initial_loss_scale must be > 0, got {self.initial_loss_scale!r}")
        if not isinstance(self.loss_scale_growth_interval, int) or self.loss_scale_growth_interval < 1:
            raise ValueError(
                "zero option loss_scale_growth_interval must be an integer >= 1, "
                f"got {self.loss_scale_growth_interval!r}"
            )
        if not self.nvme_chunk_mb > 0:
            raise ValueError(f"zero option nvme_chunk_mb must be > 0, got {self.nvme_chunk_mb!r}")

    @classmethod
    def from_spec(cls, spec: TrainSpec) -> ZeroOptions:
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(spec.options) - set(allowed))
        if unknown:
            raise ValueError(f"unknown zero option(s) {unknown}; allowed: {allowed}")
        return cls(**spec.options)

    def reduce_dtype_for(self, spec: TrainSpec) -> torch.dtype:
        return torch.float32 if self.reduce_dtype == "fp32" else spec.compute_dtype

    def bucket_numel(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return max(1, int(self.bucket_mb * 2**20) // itemsize)

    @property
    def nvme_chunk_numel(self) -> int:
        """Elements per sub-group of the streamed (nvme) optimizer step."""
        return max(1, int(self.nvme_chunk_mb * 2**20) // 4)
