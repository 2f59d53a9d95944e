"""The contract between the harness and an implementation.

An *implementation* is a factory: it says what it supports (``Capabilities``)
and, on every rank, wraps a freshly built model into an ``Engine`` for one
``TrainSpec``. The harness owns seeds, data, timing, memory and communication
measurement; an engine only trains and answers three questions (what is the
loss, what are the full parameters, how many bytes do you hold), may report a
few figures of its own (``metrics``) and releases what it holds (``close``).
``ImplementationBase`` and ``EngineBase`` supply the optional members.

An implementation may import this module, ``zbench.values``, and the two
helpers ``zbench.state_bytes`` and ``zbench.comm_labels``; nothing else of the
harness (``tests/test_layers.py`` enforces it).

Note: ``step`` returns this rank's *local* loss as a tensor rather than a
group-averaged float so that the harness can average it across ranks outside
the timed region; a logging collective must not be billed to the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from zbench.values import CATEGORIES, LOCATIONS, Offload, OptimizerName, Precision

__all__ = [
    "CATEGORIES",
    "LOCATIONS",
    "Capabilities",
    "Engine",
    "EngineBase",
    "Implementation",
    "ImplementationBase",
    "MicroBatch",
    "ModelShape",
    "TrainSpec",
    "root_held",
]


@dataclass(frozen=True)
class ModelShape:
    """What an implementation may know of the model it trains, whatever built it (a preset, a published
    architecture, a user's builder): each parameter's size and how the parameters divide into the blocks
    (``model.blocks``, the units stage 3 gathers one at a time) and the root (the rest: embeddings, final norm,
    head). Enough to account for traffic that depends on the layout (what stays gathered, what a threshold keeps
    whole), without the architecture's own configuration."""

    parameter_sizes: tuple[int, ...]
    """Elements of each distinct parameter, in ``model.parameters()`` order (a tied weight once)."""
    block_sizes: tuple[int, ...]
    """Elements each block holds alone, in order; empty when the model has no ``blocks``."""
    shared_block_parameters: int = 0
    """Elements that two or more blocks share and the root does not (a user's model may share a weight between
    blocks; presets and published architectures do not). They count in ``root_parameters``: the reference ZeRO-3
    keeps such a weight with the root, gathered from forward to backward; FSDP instead wraps the blocks that share
    it as one unit."""
    parameter_shapes: tuple[tuple[int, ...], ...] = ()
    """Shape of each distinct parameter, in the order of ``parameter_sizes``; empty where the caller knows only the
    sizes (each is then taken as one row: ``row_shard_elements`` falls back to the even split)."""

    @property
    def num_parameters(self) -> int:
        """Ψ: every distinct parameter's elements."""
        return sum(self.parameter_sizes)

    @property
    def root_parameters(self) -> int:
        """Elements no single block holds alone: the root unit's (embeddings, final norm, head; a tied weight), and
        weights blocks share."""
        return self.num_parameters - sum(self.block_sizes)

    @property
    def layers(self) -> int:
        return len(self.block_sizes)

    @property
    def last_block_parameters(self) -> int:
        """The last block's elements (0 without blocks): the one backward starts with, still gathered."""
        return self.block_sizes[-1] if self.block_sizes else 0

    def row_shard_elements(self, world: int) -> int:
        """Elements the first of ``world`` ranks holds when every parameter is split by rows (dim 0) the way
        DTensor's ``Shard(0)`` splits it, as FSDP2 does: ``ceil(rows / world)`` rows to each rank in turn, so the
        first rank holds up to one row of each parameter more than ``Ψ / world`` (and the last fewer, even none).
        Without shapes, the even split, rounded up."""
        if not self.parameter_shapes:
            return -(-self.num_parameters // world)
        return sum(-(-shape[0] // world) * math.prod(shape[1:]) if shape else 1 for shape in self.parameter_shapes)


def root_held(model: nn.Module, blocks: Iterable[nn.Module]) -> set[int]:
    """``id``s of the parameters a module outside every block registers itself (embeddings, final norm, head, a
    tied weight): the root's, found by module identity, not by name, since a published architecture's blocks are its
    decoder layers, aliased as ``model.blocks`` but first registered (and named) under the transformers model."""
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    return {id(p) for m in model.modules() if id(m) not in in_blocks for p in m.parameters(recurse=False)}


@dataclass(frozen=True)
class Tunable:
    """An option of ``TrainSpec.options`` that ``zbench tune`` searches: the values worth trying, the default first."""

    option: str
    values: tuple[Any, ...]
    """The values tried, the implementation's default first (what a setup without the option runs)."""
    stages: frozenset[int] = frozenset({0, 1, 2, 3})
    """The stages at which the option changes anything (stage 3's prefetch means nothing at stage 2)."""
    offloads: frozenset[str] | None = None
    """The offload modes at which the option changes anything (the NVMe sub-group size means nothing without
    ``nvme``); ``None``: every mode."""
    serialized_at: tuple[Any, ...] = ()
    """Values at which the implementation waits for its gathers as it issues them, so that no compute hides them (a
    ZeRO-3 prefetch of 0): the step model then charges every collective of ``serialized_phases`` as exposed, its
    reduce-scatters too (which may still overlap: a bound, not an estimate)."""
    serialized_phases: frozenset[str] = frozenset({"forward", "backward"})
    """The phases a ``serialized_at`` value serializes: both for a ZeRO-3 prefetch of 0, backward alone for
    FSDP1's backward prefetch."""
    trades: str = ""
    """What the option trades, in a few words, for ``zbench tune``'s answer."""
    searched_on: frozenset[str] = frozenset({"fitting", "GPU", "host per node"})
    """The setups ``zbench tune`` tries it on: those that fit (the fastest, each implementation's best), and those
    that missed a limit by the least (``GPU``, ``host per node``). An option that can only save host memory, never
    time nor GPU memory (smaller NVMe sub-groups), is tried on the host's near misses alone."""

    def applies(self, stage: int, offload: str | None = None) -> bool:
        """Whether the option changes anything at ``stage`` and, when given, at ``offload``."""
        return stage in self.stages and (offload is None or self.offloads is None or offload in self.offloads)


@dataclass(frozen=True)
class Capabilities:
    """What an implementation can run; the suite expander skips everything else with a reason."""

    stages: frozenset[int] = frozenset({0})
    """ZeRO stages it implements (0 means plain data parallel: DDP); the stage the formulas use."""
    precisions: frozenset[str] = frozenset({"fp32"})
    offload: frozenset[str] = frozenset({"none"})
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    optimizers: frozenset[str] = frozenset({"adamw", "sgd"})
    grad_accumulation: bool = True
    grad_clipping: bool = True
    keeps_master_weights: bool = False
    """True when mixed precision keeps a low-precision compute copy plus fp32 master weights
    (the ZeRO layout); False for autocast trainers that keep fp32 parameters (DDP, FSDP2)."""
    state_allowance: float | None = 0.05
    """How far (relative, per category) the bytes it holds may stray from what the formulas imply for its stage,
    precision and offload; ``None`` declares no layout, and the equivalence verdict says the check did not run."""
    offload_keeps_master: bool = True
    """True when offloading keeps a separate fp32 master shard on the host next to the compute shard (ZeRO-Offload,
    even in fp32); False when the offloaded fp32 shard is itself what the optimizer steps (FSDP2's CPU offload)."""
    offload_devices: frozenset[str] = frozenset({"cpu", "cuda"})
    """Devices its offload modes run on (FSDP1's CPU offload copies to an accelerator and needs one)."""
    untraceable: str | None = None
    """Why ``zbench plan --trace`` cannot run its code on fake tensors, or ``None`` (it traces)."""
    missing: str | None = None
    """Why it cannot run on this install at all (an optional dependency that is absent), or ``None``."""
    parameters_sharded_from_stage: int = 3
    """The lowest stage at which parameters are sharded *between steps*: 3 for ZeRO, whose stage 2 keeps them
    whole; 2 for FSDP1, whose ``SHARD_GRAD_OP`` frees the gathered parameters after backward and gathers them
    again in the next forward (stage 2's traffic and peak, stage 3's model states between steps)."""
    blockwise: bool = True
    """Each block adds the same bytes, collectives and operators to a rank's step, so ``zbench tune`` may trace two
    shallow cuts of a deep model and extrapolate over blocks (``zbench.tune.extrapolate``); False where a rank's
    share depends on the model as a whole (torch's ZeroRedundancyOptimizer deals whole tensors to ranks, largest
    first), which is then traced whole."""
    shards_parameters_by_rows: bool = False
    """True when it splits each parameter by rows across the ranks (DTensor's ``Shard(0)``: FSDP2), so the first
    rank holds ``ModelShape.row_shard_elements`` of every sharded category, up to a row per parameter more than
    ``Ψ / N``; False for a flat, evenly split buffer (ZeRO, FSDP1)."""
    reduce_scatter_by_all_reduce: frozenset[str] = frozenset()
    """The backends on which its reduce-scatter is an all-reduce of the whole input in place, its slice then copied
    out (the reference engine on gloo, whose own reduce-scatter clones the input first: 1.6x the time at 16 MiB on 2
    CPU cores): the step model charges it there as that all-reduce, not as the backend's reduce-scatter."""
    collectives_block_on: frozenset[str] = frozenset()
    """The backends on which it waits for every collective as it issues it (FSDP1 and FSDP2 call them without
    ``async_op``: on a GPU their overlap is CUDA streams, which a CPU does not have): the step model hides none of
    its communication there, whatever the profile's ``overlap``."""
    tunables: tuple[Tunable, ...] = ()
    """The options ``zbench tune`` searches for it (``Tunable``); none: it searches only the case's axes."""
    options: frozenset[str] | None = None
    """The option names it reads (the reference engine and DeepSpeed refuse any other when built, DDP and FSDP
    ignore the rest); ``None``: not declared. ``zbench tune --option`` gives each implementation only those it
    reads (an undeclared one, every option)."""

    def why_unsupported(
        self,
        *,
        stage: int,
        precision: str,
        offload: str,
        device: str,
        optimizer: str,
        grad_accum: int,
        grad_clip: float | None,
    ) -> str | None:
        """The reason this combination cannot run, or ``None`` when it can."""
        if self.missing:
            return self.missing
        if stage not in self.stages:
            return f"stage {stage} not supported (supports {sorted(self.stages)})"
        if precision not in self.precisions:
            return f"precision {precision} not supported (supports {sorted(self.precisions)})"
        if offload not in self.offload:
            return f"offload {offload} not supported (supports {sorted(self.offload)})"
        if device not in self.devices:
            return f"device {device} not supported (supports {sorted(self.devices)})"
        if offload != "none" and device not in self.offload_devices:
            return f"offload on {device} not supported (offload runs on {', '.join(sorted(self.offload_devices))})"
        if optimizer not in self.optimizers:
            return f"optimizer {optimizer} not supported (supports {sorted(self.optimizers)})"
        if grad_accum > 1 and not self.grad_accumulation:
            return "gradient accumulation not supported"
        if grad_clip is not None and not self.grad_clipping:
            return "gradient clipping not supported"
        return None


#: The dtype each precision computes in (autocast's under mixed precision, the parameters' in fp32).
COMPUTE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """Everything an engine needs to know about how to train; identical for every implementation of a case group."""

    device: torch.device
    precision: Precision = "fp32"
    optimizer: OptimizerName = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    grad_clip: float | None = None
    """Global gradient-norm clip (``torch.nn.utils.clip_grad_norm_`` semantics), or ``None``."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; ``Engine.step`` receives this many."""
    stage: int = 0
    offload: Offload = "none"
    nvme_dir: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """Implementation-specific knobs from the suite (bucket sizes, prefetch, ...)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.precision]

    def optimizer_class_and_kwargs(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """The torch optimizer class and its arguments (for wrappers such as ``ZeroRedundancyOptimizer``)."""
        if self.optimizer == "adamw":
            return torch.optim.AdamW, dict(
                lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=False
            )
        return torch.optim.SGD, dict(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, foreach=False)

    def make_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The optimizer every implementation must use, so that all of them train identically."""
        cls, kwargs = self.optimizer_class_and_kwargs()
        return cls(params, **kwargs)


MicroBatch = tuple[torch.Tensor, torch.Tensor]
"""``(inputs, targets)``: token ids of shape ``[micro_batch, seq]``; the model returns the mean loss."""


@runtime_checkable
class Engine(Protocol):
    """One rank's view of a model being trained by an implementation."""

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` (gradient accumulation, clipping included).

        Returns this rank's loss (mean over its micro-batches) as a detached scalar tensor.
        """

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered, fp32, on CPU, keyed by the model's own parameter names.

        Collective: every rank must call it.
        """

    def state_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds, ``{category: {location: bytes}}`` (see ``CATEGORIES``, ``LOCATIONS``).

        Measured from the tensors actually held, not computed from a formula.
        """

    def metrics(self) -> dict[str, float]:
        """Figures of the engine's own after a step, stored with each step.

        ``grad_norm`` (the 2-norm of the whole model's gradient the optimizer stepped on, after
        unscaling and before clipping) is compared with DDP's at every step: without it a gradient
        scale bug is invisible under AdamW and the case is not judged equivalent. Others are free
        (``loss_scale``, skipped steps, ...).
        """

    def close(self) -> None:
        """Release what the engine holds outside memory (swap files, threads); called once, after training."""


class EngineBase:
    """Defaults for an engine's optional members: no metrics of its own, no buffers beyond its state, nothing to
    release."""

    def metrics(self) -> dict[str, float]:
        return {}

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes by location (``host``, ``device``) of reusable buffers the engine holds beyond its model state
        (``state_bytes``), e.g. the staging buffers an NVMe tier streams its state through: ``zbench plan
        --trace`` records them and ``zbench tune`` counts them in a setup's memory. Optional: an engine without
        it holds none."""
        return {}

    def close(self) -> None:
        return None


@runtime_checkable
class Implementation(Protocol):
    """A named factory of engines. Built-ins live in ``implementations/``; users may name their own by import path."""

    name: str
    capabilities: Capabilities

    def build(self, model: nn.Module, spec: TrainSpec, group: torch.distributed.ProcessGroup | None) -> Engine:
        """Wrap ``model`` (already on ``spec.device``, identical on every rank) for training."""

    def expected_comm_elements(self, shape: ModelShape, world: int, stage: int) -> int | None:
        """Logical collective elements per step and rank this implementation should send for a model of ``shape``
        at ``world`` ranks and ``stage`` (ring algorithms, see ``zbench.measure.comms``), or ``None`` for the ZeRO
        formula of the stage."""

    def state_layout(self, spec: TrainSpec, sizes: tuple[int, ...], world: int) -> dict[str, dict[str, float]] | None:
        """Bytes per rank by category and location it holds between steps training as ``spec`` says, a model of
        parameters of ``sizes`` elements, at ``world`` ranks, where its layout departs from the ZeRO formulas
        (``zbench.cases.formulas.placement``); or ``None`` for the formulas. Optional: without it, the formulas."""


class ImplementationBase:
    """Default for an implementation's optional member: its traffic is what the ZeRO formulas say."""

    def expected_comm_elements(self, shape: ModelShape, world: int, stage: int) -> int | None:
        return None

    def state_layout(self, spec: TrainSpec, sizes: tuple[int, ...], world: int) -> dict[str, dict[str, float]] | None:
        return None
