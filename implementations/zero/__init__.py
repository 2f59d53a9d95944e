"""The reference ZeRO engine: stages 1, 2 and 3 on plain torch.distributed collectives.

Offload (``TrainSpec.offload``): ``optimizer`` (ZeRO-Offload: fp32 masters, optimizer state,
gradient partitions and the step on the host) at every stage; ``optimizer+params`` (also the
partitioned parameters on the host) at stage 3; ``nvme`` (ZeRO-Infinity: masters and optimizer
state in files under ``TrainSpec.nvme_dir``, streamed through a few buffers; at stage 3 the
parameter shards too) at every stage. ``engine.close()`` removes the swap files.

One concept per module:

- ``flat``: the flat, padded layout of a group of parameters and how it splits over ranks;
- ``params``: parameter groups whole on every rank (stages 1, 2) or sharded and gathered on demand (3);
- ``grads``: gradient buckets reduce-scattered from backward hooks (stages 2, 3);
- ``optim``: unscaling, global-norm clipping and loss scaling around the master store's step;
- ``masters``: the master store (fp32 masters, optimizer state, the step) on the device or the host;
- ``tiers``: where a rank's parameter and gradient shards live, and those kinds on the device;
- ``offload``: the host tier (pinned buffers, side-stream copies) of ZeRO-Offload;
- ``swap``, ``nvme``: the disk tier of ZeRO-Infinity: swap files with their I/O thread, and the
  master store and parameter shards streamed through them;
- ``placement``: which of those an engine gets for its offload mode (the only reader of it);
- ``engine``: what every stage answers alike (set-up, full parameters, metrics, checkpoints, ``close``) and
  the step stages 2 and 3 share;
- ``comm``, ``precision``, ``options``, ``checkpoint``, ``state``, ``loop``: the small shared pieces;
- ``stage1``, ``stage2``, ``stage3``: one engine each, built from those pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from torch import nn
from torch.distributed import ProcessGroup

from zbench.implementations.zero.options import ZeroOptions
from zbench.implementations.zero.placement import SUPPORTED
from zbench.implementations.zero.stage1 import ZeRO1Engine
from zbench.implementations.zero.stage2 import ZeRO2Engine
from zbench.implementations.zero.stage3 import ZeRO3Engine
from zbench.protocol import Capabilities, Engine, ModelShape, TrainSpec, Tunable

__all__ = ["ZERO1", "ZERO2", "ZERO3", "ZeRO1Engine", "ZeRO2Engine", "ZeRO3Engine", "ZeroImplementation", "ZeroOptions"]


#: What ``zbench tune`` searches for the engines (``ZeroOptions`` says what each does).
TUNABLES = (
    Tunable(
        "bucket_mb", (4.0, 1.0, 16.0, 64.0), stages=frozenset({1, 2}),
        trades="fewer, larger reduce-scatters (less latency) against a larger last bucket nothing hides",
    ),
    Tunable(
        "prefetch", (1, 0, 2), stages=frozenset({3}), serialized_at=(0,),
        trades="gathers hidden behind compute against gathered blocks held ahead",
    ),
    Tunable(
        "nvme_chunk_mb", (64.0, 16.0, 4.0), offloads=frozenset({"nvme"}), searched_on=frozenset({"host per node"}),
        trades="fewer optimizer calls and I/Os per step against three sub-groups' master and optimizer state "
        "buffered on the host",
    ),
)  # fmt: skip


def _capabilities(stage: int) -> Capabilities:
    return Capabilities(
        stages=frozenset({stage}),
        precisions=frozenset({"fp32", "bf16", "fp16"}),
        offload=SUPPORTED[stage],
        devices=frozenset({"cpu", "cuda"}),
        optimizers=frozenset({"adamw", "sgd"}),
        keeps_master_weights=True,
        reduce_scatter_by_all_reduce=frozenset({"gloo"}),  # comm.Comm.reduce_scatter
        tunables=TUNABLES,
        options=frozenset(f.name for f in fields(ZeroOptions)),
    )


@dataclass(frozen=True)
class ZeroImplementation:
    """The factory the harness resolves by name (``zero1``, ``zero2``, ``zero3``)."""

    name: str
    stage: int
    engine: type
    capabilities: Capabilities = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", _capabilities(self.stage))

    def expected_comm_elements(self, shape: ModelShape, world: int, stage: int) -> int:
        """Stages 1-2: reduce-scatter Ψ + all-gather Ψ. Stage 3: reduce-scatter Ψ, and gathers of Ψ for forward and
        again for backward, except the root unit and the last block, which stay gathered from forward to backward."""
        psi = shape.num_parameters
        if self.stage < 3:
            return 2 * psi
        return 3 * psi - shape.root_parameters - shape.last_block_parameters

    def build(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> Engine:
        reason = self.capabilities.why_unsupported(
            stage=self.stage,
            precision=spec.precision,
            offload=spec.offload,
            device=spec.device.type,
            optimizer=spec.optimizer,
            grad_accum=spec.grad_accum,
            grad_clip=spec.grad_clip,
        )
        if reason is not None:
            raise ValueError(f"{self.name}: {reason}")
        return self.engine(model, spec, group)


ZERO1 = ZeroImplementation("zero1", 1, ZeRO1Engine)
ZERO2 = ZeroImplementation("zero2", 2, ZeRO2Engine)
ZERO3 = ZeroImplementation("zero3", 3, ZeRO3Engine)
