"""Pre-flight: everything that must hold before the first case runs, and the suite expanded into cases.

Between parsing (``zbench.suite.config``) and running (``zbench.run.runner``): the device
is resolved (``auto`` becomes ``cuda`` where a GPU is present), world sizes are
checked against the GPUs present, every implementation is imported once (its
capabilities travel with each case from here on), the axes are expanded into
cases, and the NVMe directory is checked for room. Each failure is one
``UsageError`` (exit 2) before anything has run or been written.

Every case group (same model, world size, precision, ...) gets a DDP case,
added if the suite does not list ``ddp``, because every case is checked against
DDP. A combination an implementation does not support becomes a case that is
*skipped* with the reason, never an error.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from zbench.cases import registry
from zbench.cases.case import REFERENCE, Case
from zbench.cases.formulas import offload_supported
from zbench.cases.model_source import ModelSourceError, check_buildable, model_info
from zbench.errors import UsageError
from zbench.protocol import Capabilities, Implementation
from zbench.suite import nvme
from zbench.suite.config import ImplementationEntry, SuiteConfig, SuiteFile
from zbench.values import DeviceKind

#: The implementation that takes a suite's DeepSpeed config whole.
DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class Suite:
    """A suite ready to run: its file, the device it runs on and every case in order."""

    path: str | None
    sha256: str
    config: SuiteConfig
    cases: tuple[Case, ...]


def resolve_device(requested: str) -> DeviceKind:
    """``auto`` becomes ``cuda`` where a GPU is present, else ``cpu``; ``cuda`` without one is bad input."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "device 'cuda' requested but no CUDA GPU is available (torch.cuda.is_available() is False); "
            "use device: cpu or auto"
        )
    if requested not in ("cpu", "cuda"):
        raise UsageError(f"device {requested!r} is not one of auto, cpu, cuda")
    return "cuda" if requested == "cuda" else "cpu"


def local_ranks(device: str) -> int:
    """What ``world_sizes: [auto]`` means here: every local GPU, or 2 ranks on CPU."""
    import torch

    return torch.cuda.device_count() if device == "cuda" else 2


def resolved_world_sizes(config: SuiteConfig, device: str, nnodes: int = 1) -> list[int]:
    """The suite's world sizes with ``auto`` made a number (the local ranks times the nodes), each once, in order."""
    sizes = [local_ranks(device) * nnodes if w == "auto" else w for w in config.world_sizes]
    return list(dict.fromkeys(sizes))


def check_world_sizes(device: str, world_sizes: list[int], source: str, nnodes: int = 1) -> None:
    """Every world size splits evenly over the nodes, and each node's share fits its GPUs."""
    import torch

    uneven = [w for w in world_sizes if w % nnodes]
    if uneven:
        raise UsageError(f"{source}: world size {uneven[0]} does not split evenly over {nnodes} nodes")
    if device == "cuda":
        have = torch.cuda.device_count()
        too_big = [w for w in world_sizes if w // nnodes > have]
        if too_big:
            per_node = max(too_big) // nnodes
            where = f" on each of {nnodes} nodes" if nnodes > 1 else ""
            raise UsageError(f"{source}: world size {max(too_big)} needs {per_node} GPUs{where} but {have} present")


def entries_with_reference(config: SuiteConfig) -> list[ImplementationEntry]:
    """The suite's implementations, DDP first (added when the suite does not list it). DDP entries alike but for
    their own axes count once: a suite of chosen setups may list DDP at several micro-batches, and the reference
    runs at every shape in use anyway (``reference_shapes``)."""
    references: dict[str, ImplementationEntry] = {}
    for e in config.implementations:
        if e.name == REFERENCE:
            references.setdefault(repr(sorted(e.options.items())), e)
    others = [e for e in config.implementations if e.name != REFERENCE]
    return [*(references.values() or [ImplementationEntry(name=REFERENCE)]), *others]


def resolve_implementations(names: list[str], source: str) -> dict[str, Implementation]:
    """Import every implementation once; an unknown name or a broken import path is bad input."""
    resolved = {}
    for name in dict.fromkeys(names):
        try:
            resolved[name] = registry.resolve(name)
        except LookupError as exc:
            raise UsageError(f"{source}: implementations: {exc}") from None
    return resolved


def check_models(config: SuiteConfig, source: str) -> None:
    """Import every model builder and measure its model on the meta device (the suite parser only checked names)."""
    for model in config.models:
        try:
            info = model_info(model)
            check_buildable(info)
        except ModelSourceError as exc:
            raise UsageError(f"{source}: models: {exc}") from None
        if config.seq_len is not None and config.seq_len > info.seq:
            raise UsageError(f"{source}: seq_len {config.seq_len} exceeds model {model!r}'s max_seq_len {info.seq}")
        if any(s.checkpointing for s in reference_shapes(config)) and info.gpt is None and not info.has_blocks:
            raise UsageError(
                f"{source}: activation_checkpointing: model {model!r} has no .blocks to checkpoint "
                "(docs/methods.md#models-users-bring)"
            )


def deepspeed_settings(
    config: SuiteConfig,
    name: str,
    caps: Capabilities,
    stage: int,
    offload: str,
    options: dict[str, Any],
    device: DeviceKind,
) -> tuple[dict[str, Any], str, list[str]]:
    """(options, offload, settings not applied) for one implementation of a suite that names a DeepSpeed config.

    DeepSpeed gets the whole config (as its ``config`` option); any other implementation the settings that
    correspond, running without offload where it lacks the config's mode (the offload keys then join
    what it does not apply).
    """
    source = config.deepspeed_config
    assert source is not None
    if name == DEEPSPEED:
        return {**options, "config": source.settings}, offload, list(source.not_applied_by_deepspeed)
    not_applied = list(source.deepspeed_only)
    lacks = offload not in caps.offload or device not in caps.offload_devices or offload_supported(stage, offload)
    if offload != "none" and lacks:
        zero = source.settings.get("zero_optimization", {})
        not_applied += [f"zero_optimization.{k}" for k in ("offload_optimizer", "offload_param") if k in zero]
        offload = "none"
    return options, offload, sorted(not_applied)


@dataclass(frozen=True)
class Shape:
    """How a case trains its batch: what a case and its DDP reference must share besides model, ranks and
    precision."""

    micro_batch: int
    grad_accum: int
    checkpointing: bool


def shapes_of(config: SuiteConfig, entry: ImplementationEntry) -> list[Shape]:
    """The micro-batch x accumulation x checkpointing an entry runs at: its own where it sets them, else the
    suite's."""
    micro_batch = entry.micro_batch or config.micro_batch
    grad_accum = entry.grad_accum or config.grad_accum
    checkpointing = entry.activation_checkpointing or config.activation_checkpointing
    return [Shape(micro_batch, grad_accum, c) for c in checkpointing]


def reference_shapes(config: SuiteConfig) -> list[Shape]:
    """Every shape some entry the suite lists runs at, in the suite's order: the DDP reference runs at each."""
    return list(dict.fromkeys(s for e in config.implementations for s in shapes_of(config, e)))


def expand(config: SuiteConfig, *, device: DeviceKind, implementations: dict[str, Implementation]) -> list[Case]:
    """The cartesian product of the suite's axes as cases, DDP first in each group, unsupported ones skipped; fp32
    before the other precisions, whose cases' fp32 probes are judged against its references (``with_probes``).

    An entry that sets its own offload, micro-batch, accumulation or checkpointing (``ImplementationEntry``) runs
    at those instead of the suite's, and DDP at every shape some entry runs at."""
    cases = []
    every_shape = reference_shapes(config)
    batch_in_id = len({(s.micro_batch, s.grad_accum) for s in every_shape}) > 1
    for model, world, precision, shape, entry in itertools.product(
        config.models,
        config.world_sizes,
        sorted(config.precisions, key=lambda p: p != "fp32"),
        every_shape,
        entries_with_reference(config),
    ):
        if entry.name != REFERENCE and shape not in shapes_of(config, entry):
            continue
        caps = implementations[entry.name].capabilities
        stages = entry.stages or sorted(caps.stages)
        offloads = (entry.offload or config.offload) if entry.name != REFERENCE else ["none"]
        from_deepspeed = config.deepspeed_config is not None and entry.name != REFERENCE
        if from_deepspeed:
            stages = [config.deepspeed_config.stage]  # type: ignore[union-attr]  # (checked just above)
        for stage, offload in itertools.product(stages, offloads):
            options, not_applied = dict(entry.options), list[str]()
            if from_deepspeed:
                options, offload, not_applied = deepspeed_settings(
                    config, entry.name, caps, stage, offload, options, device
                )
            case = Case(
                model=model,
                implementation=entry.name,
                stage=stage,
                world_size=world,
                precision=precision,
                offload=offload,
                device=device,
                steps=config.steps,
                warmup_steps=config.warmup_steps,
                micro_batch=shape.micro_batch,
                grad_accum=shape.grad_accum,
                seq_len=config.seq_len or model_info(model).default_seq_len,
                seed=config.seed,
                timeout_s=config.timeout_s,
                optimizer=config.optimizer.name,
                lr=config.optimizer.lr,
                weight_decay=config.optimizer.weight_decay,
                momentum=config.optimizer.momentum,
                grad_clip=config.grad_clip,
                options=options,
                not_applied=not_applied,
                nvme_dir=config.nvme_dir,
                target_loss=config.target_loss,
                price_per_gpu_hour=config.price_per_gpu_hour,
                keep_params=config.keep_params,
                paired_rounds=config.paired_rounds,
                paired_seconds=config.paired_seconds,
                profile_steps=config.profile.steps if config.profile else [],
                activation_checkpointing=shape.checkpointing,
                batch_in_id=batch_in_id,
                capabilities=caps,
            )
            reason = offload_supported(stage, offload) or caps.why_unsupported(
                stage=stage,
                precision=precision,
                offload=offload,
                device=device,
                optimizer=case.optimizer,
                grad_accum=case.grad_accum,
                grad_clip=case.grad_clip,
            )
            cases.append(case if reason is None else case.model_copy(update={"skip_reason": reason}))
            twin = case.twin() if config.noise_twin and case.is_reference and reason is None else None
            if twin is not None:
                cases.append(twin)
    return with_probes(cases, config.fp32_probe_steps) if config.fp32_probe else cases


def probe_applies(case: Case) -> bool:
    """A bf16/fp16 case that runs, is judged against DDP, and whose implementation trains it in fp32 too."""
    if case.precision == "fp32" or case.skip_reason or case.is_reference or case.noise_twin:
        return False
    caps = case.capabilities
    return caps is None or (
        caps.why_unsupported(
            stage=case.stage,
            precision="fp32",
            offload=case.offload,
            device=case.device,
            optimizer=case.optimizer,
            grad_accum=case.grad_accum,
            grad_clip=case.grad_clip,
        )
        is None
    )


def with_probes(cases: list[Case], probe_steps: int | None = None) -> list[Case]:
    """``cases`` with ``fp32_probe`` set where it applies, and the fp32 DDP reference (and twin) those probes are
    judged against inserted before their group when the suite has no such fp32 group.

    ``probe_steps`` (fewer than a case's steps) caps the probes' steps: an inserted reference and twin train only
    that many, and the suite's own fp32 reference and twin keep their parameters after that step too
    (``Case.probe_reference_keys``)."""

    def fp32_key(case: Case) -> tuple[object, ...]:
        return case.probe_reference_keys[0]  # (no probe_steps yet: the only key)

    probed = {fp32_key(c) for c in cases if probe_applies(c)}
    fp32_groups = {c.reference_key for c in cases if c.is_reference}
    out: list[Case] = []
    for case in cases:
        if case.is_reference and fp32_key(case) in probed and fp32_key(case) not in fp32_groups:
            steps = min(case.steps, probe_steps or case.steps)  # its first steps are the long run's, bit for bit
            reference = case.model_copy(
                update={"precision": "fp32", "steps": steps, "warmup_steps": min(case.warmup_steps, steps - 1)}
            )
            twinned = any(c.noise_twin and c.reference_key == case.reference_key for c in cases)
            twin = reference.twin() if twinned else None
            out += [reference, *([twin] if twin else [])]
            fp32_groups.add(fp32_key(case))
        if probe_applies(case):
            out.append(with_probe_steps(case.model_copy(update={"fp32_probe": True}), probe_steps))
        elif case.precision == "fp32" and case.implementation == REFERENCE and case.reference_key in probed:
            out.append(with_probe_steps(case, probe_steps))  # an fp32 reference or twin that probes are judged by
        else:
            out.append(case)
    return out


def with_probe_steps(case: Case, probe_steps: int | None) -> Case:
    """``case`` with ``probe_steps`` set when the suite's cap is below its steps."""
    if probe_steps is None or probe_steps >= case.steps:
        return case
    return case.model_copy(update={"probe_steps": probe_steps})


def prepare(suite: SuiteFile, *, nnodes: int = 1) -> Suite:
    """Check the machine against the suite and expand it; every problem is one ``UsageError`` naming the suite.

    ``nnodes``: the nodes the run spans, each assumed to be like this one (as torchrun assumes).
    """
    source = suite.path or "suite"
    device = resolve_device(suite.config.device)
    world_sizes = resolved_world_sizes(suite.config, device, nnodes)
    config = suite.config.model_copy(update={"world_sizes": world_sizes})
    check_world_sizes(device, world_sizes, source, nnodes)
    implementations = resolve_implementations([e.name for e in entries_with_reference(config)], source)
    check_models(config, source)
    cases = tuple(expand(config, device=device, implementations=implementations))
    nvme.check_suite(cases, config.nvme_dir)
    return Suite(path=suite.path, sha256=suite.sha256, config=config, cases=cases)
