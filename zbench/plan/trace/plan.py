"""``zbench plan --trace``: every implementation x stage x offload traced at the user's scale, next to the formulas.

One process joins a fake process group of ``gpus`` ranks as rank 0 and runs
``trace_case`` for each combination an implementation supports. Each row holds
the traced model states by category and location, the ZeRO formula's figures
(``zbench.cases.formulas.placement_for``, the layout the implementation declares), the
peak of live tensor bytes with its composition, and the collectives of a step.
Where traced and formula differ by more than 2% in a category the row says by
how much and why (``explain``).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.formulas import offload_supported, placement_for
from zbench.depth import split_depth
from zbench.plan.trace.heartbeat import Heartbeat
from zbench.plan.trace.shims import fake_world
from zbench.plan.trace.tracer import TraceResult, trace_case, why_untraceable
from zbench.values import CATEGORIES, LOCATIONS, OFFLOAD_MODES

#: Warnings torch gives on every trace that say nothing about the user's setup: FSDP1's NO_SHARD (zbench's FSDP1
#: at stage 0, kept as the DDP-like baseline) is deprecated, and FSDP1 reads a data pointer of a fake tensor.
QUIET = ("The `NO_SHARD` sharding strategy is deprecated", "Accessing the data pointer of FakeTensor is deprecated")

#: Differences per category under this share of the formula are rounding, not worth a line.
TOLERANCE = 0.02

#: Why a category can differ from the formula, by implementation family and category (docs/methods.md#tracing).
REASONS: dict[tuple[str, str], str] = {
    ("zero", "parameters"): "flat buffers are padded to a multiple of the world size; each rank holds its padded shard",
    ("zero", "gradients"): "the engine keeps gradients in its own flat layout (padding, and at stage 1 a full "
    "compute-precision buffer)",
    ("zero", "master_weights"): "padded fp32 shard",
    ("zero", "optimizer_state"): "padded fp32 shard",
    ("fsdp", "parameters"): "FSDP2 pads each parameter's dim-0 (FSDP1 each unit's flat parameter) to a "
    "multiple of the world size; a small parameter's shard is mostly padding at many ranks",
    ("fsdp", "gradients"): "gradients follow the padded parameter shards",
    ("fsdp", "optimizer_state"): "optimizer state follows the padded parameter shards",
    ("torch_zero", "optimizer_state"): "ZeroRedundancyOptimizer gives whole parameters to ranks (largest first): "
    "a rank holds at least one whole tensor's state, e.g. the embedding's, however many ranks there are",
}


def family(implementation: str) -> str:
    if implementation.startswith("zero"):
        return "zero"
    return "fsdp" if implementation in ("fsdp", "fsdp1") else implementation


def explain(implementation: str, traced: dict[str, dict[str, int]], formula: dict[str, dict[str, float]]) -> list[str]:
    """One line per category and location where the trace and the formula differ by more than ``TOLERANCE``."""
    lines = []
    for cat in CATEGORIES:
        for loc in LOCATIONS:
            got, want = traced.get(cat, {}).get(loc, 0), formula.get(cat, {}).get(loc, 0.0)
            if abs(got - want) <= TOLERANCE * max(want, 1.0) or (got == 0 and want == 0):
                continue
            share = f"{(got - want) / want:+.1%}" if want else "not in the formula"
            reason = REASONS.get((family(implementation), cat), "not modelled by the formula")
            lines.append(f"{cat} on {loc}: {share} ({reason})")
    return lines


def case_name(case: Case) -> str:
    """An implementation at its stage and offload mode: ``zero3 (stage 3) + offload optimizer``."""
    off = "" if case.offload == "none" else f" + offload {case.offload}"
    return f"{case.implementation} (stage {case.stage}){off}"


@dataclass
class TracedRow:
    case: Case
    trace: TraceResult
    formula: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return case_name(self.case)

    def located(self, where: str, source: str = "traced") -> float:
        data: dict[str, dict[str, Any]] = self.trace.state_bytes if source == "traced" else self.formula
        return float(sum(data.get(cat, {}).get(where, 0) for cat in CATEGORIES))

    @property
    def differences(self) -> list[str]:
        return [] if self.trace.error else explain(self.case.implementation, self.trace.state_bytes, self.formula)

    def peak(self, where: str = "device") -> int:
        return int(self.trace.peak.get(where, {}).get("bytes", 0))

    def host_held(self) -> float:
        """Bytes a rank holds on the host: its host-located state and the engine's host buffers (an NVMe tier's
        staging, ``TraceResult.buffers``)."""
        return self.located("host") + self.trace.buffers.get("host", 0)

    def host_held_in_peak(self) -> float:
        """Host-held bytes the device's peak counts: on the CPU stand-in (fake CPU tensors) host copies share the
        traced device's memory, so its peak includes them; on fake cuda, nothing."""
        return self.host_held() if self.case.device == "cpu" else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "implementation": self.case.implementation,
            "stage": self.case.stage,
            "offload": self.case.offload,
            "trace": self.trace.to_json(),
            "formula": self.formula,
            "differences": self.differences,
        }


def untraceable(implementations: Iterable[str]) -> dict[str, str]:
    """The implementations whose code cannot be traced here, with the reason."""
    return {name: reason for name in implementations if (reason := why_untraceable(name))}


def taken_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` (``--option``) implementation ``name`` reads (``Capabilities.options``; all where it declares
    none): the reference engine would refuse DeepSpeed's ``bucket_size``, and DDP is not a setup of FSDP's
    ``prefetch``."""
    accepted = registry.resolve(name).capabilities.options
    return {k: v for k, v in options.items() if accepted is None or k in accepted}


def untaken_option(names: Iterable[str], options: dict[str, Any]) -> str | None:
    """One line naming an option none of ``names`` reads, with what each reads; ``None`` when each is read."""
    declared = {name: registry.resolve(name).capabilities.options for name in names}
    for key in options:
        if all(accepted is not None and key not in accepted for accepted in declared.values()):
            reads = "; ".join(f"{n}: {', '.join(sorted(a))}" for n, a in declared.items() if a)
            return f"--option {key}: none of the implementations given takes it ({reads or 'they take none'})"
    return None


def combinations(
    implementations: Iterable[str], offloads: Iterable[str], device: str | None = None
) -> list[tuple[str, int, str]]:
    """(implementation, stage, offload) for every stage and offload mode an implementation declares (and runs on
    ``device``, when given), of the implementations that can be traced."""
    out: list[tuple[str, int, str]] = []
    for name in implementations:
        if why_untraceable(name):
            continue
        caps = registry.resolve(name).capabilities
        for stage in sorted(caps.stages):
            for offload in OFFLOAD_MODES:
                if offload not in offloads or offload not in caps.offload or offload_supported(stage, offload):
                    continue
                if offload == "none" or device is None or device in caps.offload_devices:
                    out.append((name, stage, offload))
    return out


def make_case(
    model: str,
    implementation: str,
    stage: int,
    offload: str,
    *,
    gpus: int,
    precision: str,
    micro_batch: int,
    seq_len: int,
    device: str,
    checkpointing: bool,
    options: dict[str, Any] | None = None,
) -> Case:
    return Case(
        model=model,
        implementation=implementation,
        stage=stage,
        world_size=gpus,
        precision=precision,
        offload=offload,
        device=device,
        steps=3,
        warmup_steps=0,
        micro_batch=micro_batch,
        grad_accum=1,
        seq_len=seq_len,
        seed=0,
        timeout_s=0,
        optimizer="adamw",
        lr=1e-4,
        weight_decay=0.0,
        momentum=0.0,
        grad_clip=None,
        activation_checkpointing=checkpointing,
        capabilities=registry.resolve(implementation).capabilities,
        options=dict(options or {}),
    )


def cuda_traceable() -> bool:
    """Whether fake CUDA tensors can be traced through a training step here: a torch built with CUDA *and* a
    visible GPU.

    Fake tensors run no kernel, but backward still enters torch's C++ autograd engine, which asks the CUDA
    driver for each device's primary context (``GraphTask::stash_current_streams``): a CPU-only torch has no
    CUDA runtime to ask, and a CUDA build on a machine without a GPU fails there ("hasPrimaryContext expects
    a valid device index", torch 2.14). Both trace on fake CPU tensors instead (``why_not_cuda``).
    """
    return why_not_cuda() is None


def why_not_cuda() -> str | None:
    """Why fake CUDA tensors cannot be traced here (``cuda_traceable``), or None."""
    if not torch.cuda._is_compiled():
        return "this torch is built without CUDA"
    if torch.cuda.device_count() == 0:
        return f"no GPU is visible (torch {torch.__version__}'s autograd engine needs one even for fake tensors)"
    return None


def default_device() -> str:
    """cuda where fake CUDA tensors can be traced, else fake CPU tensors stand in for the device."""
    return "cuda" if cuda_traceable() else "cpu"


def trace_plan(
    cases: list[Case], *, device: str, backend: str = "nccl", progress: Callable[[str], None] | None = None
) -> list[TracedRow]:
    """Trace every case (all of one world size) in one fake process group, as rank 0.

    With ``progress``, a line per case and, while a case traces, a heartbeat (:class:`Heartbeat`).
    """
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    rows = []
    with (
        fake_world(cases[0].world_size, backend=backend),
        Heartbeat(progress or (lambda _: None)) as beat,
        warnings.catch_warnings(),
    ):
        for message in QUIET:
            warnings.filterwarnings("ignore", message=message)
        for i, case in enumerate(cases, 1):
            what = f"{case.implementation} stage {case.stage} offload {case.offload}"
            if case.micro_batch > 1 or case.grad_accum > 1 or case.activation_checkpointing:
                accum = f" x {case.grad_accum}" if case.grad_accum > 1 else ""
                what += f", micro-batch {case.micro_batch}{accum}" + (
                    ", checkpointing" if case.activation_checkpointing else ""
                )
            what += case.options_text
            if (blocks := split_depth(case.model)[1]) is not None:  # tune's cuts: two lines a setup, told apart
                what += f", cut to {blocks} blocks"
            if progress:
                progress(f"[{i}/{len(cases)}] tracing {what}")
            beat.task(what)
            trace = trace_case(case, fake=True, device=dev, on_phase=beat.phase)
            rows.append(TracedRow(case, trace, placement_for(case)))
    return rows


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
