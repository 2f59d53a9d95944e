"""Suite files: YAML (safe-loaded) validated into frozen config objects, expanded into cases.

A suite is a set of axes (models × implementations × stages × world sizes ×
precisions × offload modes) plus the training settings every case shares. Its
cartesian product becomes ``Case`` objects; a combination an implementation
does not support becomes a case that is *skipped* with the reason, never an
error. Every case group (same model, world size, precision, ...) gets a DDP
case, added if the suite does not list ``ddp``, because every case is checked
against DDP.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from zbench import nvme, registry
from zbench.errors import UsageError
from zbench.models import PRESETS, get_config

REFERENCE = "ddp"


def _as_list(value: Any) -> Any:
    """Let a single value stand for a one-element axis: ``precisions: fp32``."""
    return value if isinstance(value, list) else [value]


def _implementation_entries(value: Any) -> Any:
    """``ddp`` is short for ``{name: ddp}``."""
    return [{"name": v} if isinstance(v, str) else v for v in _as_list(value)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OptimizerConfig(_Frozen):
    """The optimizer every implementation in the suite uses."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0, lt=1)


class RegressionConfig(_Frozen):
    """Thresholds ``zbench check`` applies to this suite's runs (see ``zbench.regress.Thresholds``)."""

    time_pct: float = Field(5.0, gt=0)
    memory_pct: float = Field(2.0, gt=0)
    memory_floor_bytes: int = Field(1 << 20, ge=0)
    p_value: float = Field(0.01, gt=0, lt=1)


class ImplementationEntry(_Frozen):
    """An implementation with settings: ``{name: zero3, options: {prefetch: 2}}``."""

    name: str
    stages: Annotated[list[Annotated[int, Field(ge=1, le=3)]], BeforeValidator(_as_list)] | None = None
    """For implementations that support several stages: which to run (default: all it supports)."""
    options: dict[str, Any] = Field(default_factory=dict)


class SuiteConfig(_Frozen):
    """The validated content of a suite file."""

    name: str = "suite"
    description: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    models: Annotated[list[str], BeforeValidator(_as_list)] = Field(min_length=1)
    implementations: Annotated[list[ImplementationEntry], BeforeValidator(_implementation_entries)] = Field(min_length=1)
    world_sizes: Annotated[list[Annotated[int, Field(ge=1)]], BeforeValidator(_as_list)] = Field(min_length=1)
    precisions: Annotated[list[Literal["fp32", "bf16", "fp16"]], BeforeValidator(_as_list)] = ["fp32"]
    offload: Annotated[list[Literal["none", "optimizer", "optimizer+params", "nvme"]], BeforeValidator(_as_list)] = ["none"]
    steps: int = Field(20, ge=1)
    warmup_steps: int = Field(3, ge=0)
    micro_batch: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    seq_len: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0)
    timeout_s: float = Field(600.0, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig()
    grad_clip: float | None = Field(None, gt=0)
    nvme_dir: str | None = None
    target_loss: float | None = Field(None, gt=0)
    """Record the steps and time each case needs to reach this loss (time to target)."""
    regression: RegressionConfig = RegressionConfig()

    @field_validator("models")
    @classmethod
    def _known_models(cls, models: list[str]) -> list[str]:
        for m in models:
            if m not in PRESETS:
                raise ValueError(f"unknown model {m!r}; allowed: {', '.join(PRESETS)}")
        return models

    @field_validator("implementations")
    @classmethod
    def _known_implementations(cls, entries: list[ImplementationEntry]) -> list[ImplementationEntry]:
        for e in entries:
            try:
                registry.resolve(e.name)
            except LookupError as exc:
                raise ValueError(str(exc)) from None
        return entries

    @model_validator(mode="after")
    def _consistent(self) -> "SuiteConfig":
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be less than steps ({self.steps})")
        if self.seq_len is not None:
            for m in self.models:
                if self.seq_len > get_config(m).seq:
                    raise ValueError(f"seq_len {self.seq_len} exceeds model {m!r}'s context {get_config(m).seq}")
        return self


@dataclass(frozen=True)
class Case:
    """One process group's worth of work: an implementation at one point of the suite's axes."""

    model: str
    implementation: str
    stage: int
    world_size: int
    precision: str
    offload: str
    device: str
    steps: int
    warmup_steps: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    seed: int
    timeout_s: float
    optimizer: str
    lr: float
    weight_decay: float
    momentum: float
    grad_clip: float | None
    options: tuple[tuple[str, Any], ...] = ()
    nvme_dir: str | None = None
    target_loss: float | None = None
    skip_reason: str | None = None

    @property
    def case_id(self) -> str:
        """A readable, filesystem-safe id unique within a run."""
        impl = re.sub(r"[^A-Za-z0-9_.+-]", "_", self.implementation)
        parts = [self.model, impl, f"s{self.stage}", f"w{self.world_size}", self.precision, self.offload.replace("+", "_")]
        if self.options:
            parts.append(hashlib.sha1(repr(self.options).encode()).hexdigest()[:6])
        return "-".join(parts)

    @property
    def reference_key(self) -> tuple:
        """Cases with the same key train the same thing and are compared with the same DDP case."""
        return (self.model, self.world_size, self.precision, self.device, self.steps, self.micro_batch,
                self.grad_accum, self.seq_len, self.seed, self.optimizer, self.lr, self.weight_decay,
                self.momentum, self.grad_clip)

    @property
    def is_reference(self) -> bool:
        return self.implementation == REFERENCE

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Case":
        """The inverse of ``to_dict`` (reads a stored case's ``config``)."""
        fields = {k: v for k, v in d.items() if k != "case_id"}
        fields["options"] = tuple(sorted((fields.get("options") or {}).items()))
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = dict(self.options)
        d["case_id"] = self.case_id
        return d


@dataclass(frozen=True)
class Suite:
    path: str | None
    sha256: str
    config: SuiteConfig
    cases: tuple[Case, ...]


def format_validation_error(source: str, exc: ValidationError) -> str:
    """One line: where, which field, what value, what is allowed."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(err["loc"])
        return f"{source}: unknown key {field!r}; allowed keys: {', '.join(allowed)}"
    if err["type"] == "missing":
        return f"{source}: missing required key {field!r}"
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) else f" (got {value!r})"
    where = f" {field}:" if field else ""
    return f"{source}:{where} {msg}{shown}"


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = SuiteConfig
    if loc and loc[0] == "optimizer":
        model = OptimizerConfig
    elif loc and loc[0] == "regression":
        model = RegressionConfig
    elif loc and loc[0] == "implementations":
        model = ImplementationEntry
    return list(model.model_fields)


def resolve_device(requested: str) -> str:
    """``auto`` becomes ``cuda`` where a GPU is present, else ``cpu``; ``cuda`` without one is bad input."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' requested but no CUDA GPU is available (torch.cuda.is_available() is False); "
                         "use device: cpu or auto")
    return requested


def check_world_sizes(device: str, world_sizes: list[int], source: str) -> None:
    import torch

    if device == "cuda":
        have = torch.cuda.device_count()
        too_big = [w for w in world_sizes if w > have]
        if too_big:
            raise UsageError(f"{source}: world size {max(too_big)} needs {max(too_big)} GPUs but {have} present")


def expand(config: SuiteConfig) -> list[Case]:
    """The cartesian product of the suite's axes as cases, DDP first in each group, unsupported ones skipped."""
    device = resolve_device(config.device)
    entries = list(config.implementations)
    if not any(e.name == REFERENCE for e in entries):
        entries.insert(0, ImplementationEntry(name=REFERENCE))
    entries.sort(key=lambda e: e.name != REFERENCE)
    cases = []
    for model, world, precision, entry in itertools.product(config.models, config.world_sizes, config.precisions, entries):
        impl = registry.resolve(entry.name)
        stages = entry.stages or sorted(impl.capabilities.stages)
        offloads = config.offload if entry.name != REFERENCE else ["none"]
        for stage, offload in itertools.product(stages, offloads):
            case = Case(
                model=model, implementation=entry.name, stage=stage, world_size=world, precision=precision,
                offload=offload, device=device, steps=config.steps, warmup_steps=config.warmup_steps,
                micro_batch=config.micro_batch, grad_accum=config.grad_accum,
                seq_len=config.seq_len or get_config(model).seq, seed=config.seed, timeout_s=config.timeout_s,
                optimizer=config.optimizer.name, lr=config.optimizer.lr, weight_decay=config.optimizer.weight_decay,
                momentum=config.optimizer.momentum, grad_clip=config.grad_clip,
                options=tuple(sorted(entry.options.items())), nvme_dir=config.nvme_dir, target_loss=config.target_loss)
            reason = impl.capabilities.why_unsupported(
                stage=stage, precision=precision, offload=offload, device=device, optimizer=case.optimizer,
                grad_accum=case.grad_accum, grad_clip=case.grad_clip)
            cases.append(case if reason is None else _skipped(case, reason))
    return cases


def _skipped(case: Case, reason: str) -> Case:
    from dataclasses import replace

    return replace(case, skip_reason=reason)


def from_dict(data: Any, *, source: str = "suite") -> SuiteConfig:
    if not isinstance(data, dict):
        raise UsageError(f"{source}: a suite must be a YAML mapping of keys to values, got {type(data).__name__}")
    try:
        return SuiteConfig(**data)
    except ValidationError as exc:
        raise UsageError(format_validation_error(source, exc)) from None
    except TypeError as exc:  # non-string keys
        raise UsageError(f"{source}: {exc}") from None


def load(path: str | Path) -> Suite:
    """Read, validate and expand a suite file; every problem is a ``UsageError`` naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: suite file not found") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read suite file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{path}:{where}: malformed YAML: {problem}") from None
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    config = from_dict(data, source=str(path))
    return build(config, path=str(path), raw=raw)


def build(config: SuiteConfig, *, path: str | None, raw: bytes | None = None) -> Suite:
    source = path or "suite"
    device = resolve_device(config.device)
    check_world_sizes(device, config.world_sizes, source)
    raw = raw if raw is not None else config.model_dump_json().encode()
    cases = tuple(expand(config))
    nvme.check_suite(cases, config.nvme_dir)
    return Suite(path=path, sha256=hashlib.sha256(raw).hexdigest(), config=config, cases=cases)
