"""One case: an implementation at one point of a suite's axes, the unit the harness launches, stores and compares.

A ``Case`` keeps one form from suite expansion to the report: the expander
builds it (with the implementation's capabilities, resolved once per run), the
launcher hands it to every rank as JSON, the worker builds its ``TrainSpec``
from it, and the stored record carries it as its ``config``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from zbench.protocol import Capabilities, TrainSpec
from zbench.values import DeviceKind, Offload, OptimizerName, Precision

#: The implementation every case is checked against.
REFERENCE = "ddp"


class Case(BaseModel):
    """Everything one process group needs to train one implementation the way its case group does."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model: str
    implementation: str
    """Built-in name or ``module:attribute`` import path."""
    stage: int
    world_size: int
    precision: Precision
    offload: Offload
    device: DeviceKind
    steps: int
    warmup_steps: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    seed: int
    timeout_s: float
    optimizer: OptimizerName
    lr: float
    weight_decay: float
    momentum: float
    grad_clip: float | None
    options: dict[str, Any] = Field(default_factory=dict)
    """Implementation-specific knobs from the suite (bucket sizes, prefetch, ...)."""
    activation_checkpointing: bool = False
    """Every block's activations recomputed in backward (``zbench.cases.models.checkpoint_blocks``)."""
    batch_in_id: bool = False
    """The case id names the micro-batch and accumulation: set when the suite runs more than one of them (entries
    with their own, ``suite.config.ImplementationEntry``), so that ids stay unique and a cross product's stay as
    they always were."""
    nvme_dir: str | None = None
    """The suite's NVMe directory (each case swaps into its own sub-directory of it, see ``zbench.suite.nvme``)."""
    target_loss: float | None = None
    price_per_gpu_hour: float | None = None
    """Cost of one rank for an hour (the suite's ``price_per_gpu_hour``), for the cost columns."""
    keep_params: bool = False
    """Keep the final-parameter file after the equivalence verdict is stored."""
    noise_twin: bool = False
    """A second DDP run of a case group that splits each rank's batch into twice (or half) as many micro-batches:
    the same training summed in another order. Its distance from the reference is the group's measured noise
    floor, which sets the equivalence bounds (docs/methods.md#equivalence)."""
    fp32_probe: bool = False
    """A bf16 or fp16 case trains again in fp32 after its run (the same ranks, implementation, options and data),
    judged against its group's fp32 DDP reference with the fp32 bounds: a logic bug that fp32 catches is not
    hidden by bf16's wider noise (``zbench.rank.probe``, docs/methods.md#bf16-verdicts)."""
    probe_steps: int | None = None
    """Fewer steps than ``steps`` for the fp32 probe (the suite's ``fp32_probe_steps``): on a probed case, the
    steps its probe trains; on the suite's fp32 DDP reference and twin the probes are judged against, the step after
    which they also keep their parameters (``CaseFiles.probe_params``). ``None``: all steps. Not part of what is
    trained or compared."""
    paired_rounds: int = 0
    """After training, rounds of one step of this case and one of a DDP copy of its model, alternating
    (``zbench.rank.paired``): the regression gate's samples. Not part of what is trained or compared."""
    paired_seconds: float = 0.0
    """...and more rounds until this long has passed: the gate's power on a noisy machine."""
    profile_steps: list[int] = Field(default_factory=list)
    """Steps every rank records a torch.profiler trace of (the suite's ``profile.steps``), left out of the step-time
    statistics. Not part of what is trained or compared."""
    skip_reason: str | None = None
    not_applied: list[str] = Field(default_factory=list)
    """Settings of the suite's DeepSpeed config this implementation does not apply (``suite.deepspeed_config``)."""
    capabilities: Capabilities | None = None
    """What the implementation declared when the run resolved it; ``None`` in records from schema 1."""

    @property
    def case_id(self) -> str:
        """A readable, filesystem-safe id unique within a run."""
        impl = re.sub(r"[^A-Za-z0-9_.+-]", "_", self.implementation)
        parts = [
            re.sub(r"[^A-Za-z0-9_.+-]", "_", self.model),
            impl,
            f"s{self.stage}",
            f"w{self.world_size}",
            self.precision,
            self.offload.replace("+", "_"),
        ]
        if self.options:
            parts.append(hashlib.sha1(repr(tuple(sorted(self.options.items()))).encode()).hexdigest()[:6])
        if self.batch_in_id:
            parts.append(f"mb{self.micro_batch}" + (f"x{self.grad_accum}" if self.grad_accum > 1 else ""))
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.noise_twin:
            parts.append("twin")
        return "-".join(parts)

    @property
    def options_text(self) -> str:
        """The options as ``, key value`` phrases in key order (empty without any): one wording for every line that
        names a setup (``zbench tune``'s tables, a trace's progress)."""
        words = (f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(self.options.items()))
        return "".join(f", {w}" for w in words)

    @property
    def reference_key(self) -> tuple[Any, ...]:
        """Cases with the same key train the same thing and are compared with the same DDP case."""
        return (
            self.model,
            self.world_size,
            self.precision,
            self.device,
            self.steps,
            self.micro_batch,
            self.grad_accum,
            self.seq_len,
            self.seed,
            self.optimizer,
            self.lr,
            self.weight_decay,
            self.momentum,
            self.grad_clip,
            self.activation_checkpointing,
        )

    @property
    def probe_reference_keys(self) -> tuple[tuple[Any, ...], ...]:
        """The ``reference_key`` of each fp32 group whose DDP reference and twin may judge this case's fp32 probe,
        the first preferred: the suite's own fp32 group (of the case's length: with ``probe_steps`` its reference
        and twin keep their parameters after that step), then, for a capped probe, a group trained for the
        probe's steps alone (what the suite adds when it has no fp32 group: ``preflight.with_probes``)."""
        fp32 = self.model_copy(update={"precision": "fp32"})
        short = [fp32.model_copy(update={"steps": self.probe_steps}).reference_key] if self.probe_steps else []
        return (fp32.reference_key, *short)

    @property
    def is_reference(self) -> bool:
        return self.implementation == REFERENCE and not self.noise_twin

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches each rank's share of the batch is split into (the noise twin splits it another way)."""
        if not self.noise_twin:
            return self.grad_accum
        return self.grad_accum * 2 if self.micro_batch % 2 == 0 else self.grad_accum // 2

    def twin(self) -> Case | None:
        """This reference's noise twin, or ``None`` when its batch cannot be split into equal micro-batches
        another way (an odd micro-batch and an odd accumulation count)."""
        if self.micro_batch % 2 and self.grad_accum % 2:
            return None
        return self.model_copy(update={"noise_twin": True})

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup_steps

    def train_spec(self, device: torch.device, *, swap_dir: str | None = None) -> TrainSpec:
        """How every rank's engine trains; ``swap_dir`` is this case's private NVMe directory, if it has one."""
        return TrainSpec(
            device=device,
            precision=self.precision,
            optimizer=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            grad_clip=self.grad_clip,
            grad_accum=self.micro_batches_per_step,
            stage=self.stage,
            offload=self.offload,
            nvme_dir=swap_dir,
            options=dict(self.options),
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The stored form (with ``case_id`` for people reading the file; it is derived again on load)."""
        return {**self.model_dump(mode="json"), "case_id": self.case_id}
