"""Suite files: YAML (safe-loaded) validated into frozen config objects. Parsing only.

A suite is a set of axes (models × implementations × stages × world sizes ×
precisions × offload modes) plus the training settings every case shares.
This module reads and validates it and nothing more: it imports no
implementation and probes no device or directory (``tests/test_layers.py``
holds it to that). ``zbench.suite.preflight`` resolves the implementations, checks the
machine and expands the axes into cases.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from zbench.cases.model_names import check_model_name
from zbench.errors import UsageError
from zbench.presets import PRESETS
from zbench.values import Offload, OptimizerName, Precision


def _as_list(value: Any) -> Any:
    """Let a single value stand for a one-element axis: ``precisions: fp32``."""
    return value if isinstance(value, list) else [value]


def _world_size(value: Any) -> int | str:
    """A positive number of ranks, or ``auto`` (every local GPU, or 2 ranks on CPU)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError("a world size is a positive number of ranks, or auto")


WorldSize = Annotated[int | Literal["auto"], PlainValidator(_world_size)]


def _implementation_entries(value: Any) -> Any:
    """``ddp`` is short for ``{name: ddp}``."""
    return [{"name": v} if isinstance(v, str) else v for v in _as_list(value)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OptimizerConfig(_Frozen):
    """The optimizer every implementation in the suite uses."""

    name: OptimizerName = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0, lt=1)


class RegressionConfig(_Frozen):
    """Thresholds ``zbench check`` applies to this suite's runs (see ``zbench.verdicts.regress.Thresholds``)."""

    time_pct: float = Field(5.0, gt=0)
    memory_pct: float = Field(2.0, gt=0)
    memory_floor_bytes: int = Field(1 << 20, ge=0)
    rss_floor_bytes: int = Field(32 << 20, ge=0)
    p_value: float = Field(0.01, gt=0, lt=1)
    baseline_runs: int = Field(5, ge=1)
    spread_factor: float = Field(2.0, ge=0)


class ProfileConfig(_Frozen):
    """Training steps to record a torch.profiler trace of, on every rank (``zbench.measure.profile``)."""

    steps: Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_as_list)] = Field(min_length=1)
    """Step numbers as the record counts them (from 0); these steps are left out of the step-time statistics."""

    @field_validator("steps")
    @classmethod
    def _sorted(cls, steps: list[int]) -> list[int]:
        """Order and repeats mean nothing: a step is profiled or not."""
        return sorted(set(steps))


class ImplementationEntry(_Frozen):
    """An implementation with settings: ``{name: zero3, options: {prefetch: 2}}``.

    An entry may also set its own offload modes, micro-batch, accumulation and checkpointing, in place of the
    suite's: a suite of chosen setups (what ``zbench tune --emit-suite`` writes) is a list of entries, each one
    setup, rather than a cross product. The DDP reference then runs at every micro-batch, accumulation and
    checkpointing an entry asks for, since each case is compared with a DDP case trained the same way.
    """

    name: str
    stages: Annotated[list[Annotated[int, Field(ge=0, le=3)]], BeforeValidator(_as_list)] | None = None
    """For implementations that support several stages: which to run (default: all it supports; 0 is FSDP1's
    NO_SHARD)."""
    options: dict[str, Any] = Field(default_factory=dict)
    offload: Annotated[list[Offload], BeforeValidator(_as_list)] | None = None
    micro_batch: int | None = Field(None, ge=1)
    grad_accum: int | None = Field(None, ge=1)
    activation_checkpointing: Annotated[list[bool], BeforeValidator(_as_list)] | None = None

    #: The entry keys that override one of the suite's axes.
    AXES: ClassVar[tuple[str, ...]] = ("offload", "micro_batch", "grad_accum", "activation_checkpointing")

    def axes_set(self) -> list[str]:
        """The suite axes this entry sets for itself."""
        return [k for k in self.AXES if getattr(self, k) is not None]


class DeepSpeedSource(_Frozen):
    """A DeepSpeed JSON config the suite trains (``zbench.suite.deepspeed_config``): read, mapped, kept whole."""

    path: str
    stage: int
    settings: dict[str, Any]
    deepspeed_only: list[str] = Field(default_factory=list)
    not_applied_by_deepspeed: list[str] = Field(default_factory=list)


#: Suite keys a DeepSpeed config sets; a suite naming a config must leave them to it.
DEEPSPEED_SETS = ("precisions", "offload", "micro_batch", "grad_accum", "grad_clip", "optimizer")


def _with_deepspeed_config(data: dict[str, Any], base: Path, source: str) -> dict[str, Any]:
    """``data`` with the settings of the DeepSpeed config it names (a path relative to ``base``) filled in."""
    from zbench.suite.deepspeed_config import DeepSpeedConfigError
    from zbench.suite.deepspeed_config import read as read_deepspeed

    named = data.get("deepspeed_config")
    if not isinstance(named, str):
        return data
    path = Path(named) if Path(named).is_absolute() else base / named
    try:
        mapped = read_deepspeed(path)
    except DeepSpeedConfigError as exc:
        raise UsageError(f"{source}: deepspeed_config: {exc}") from None
    both = [k for k in DEEPSPEED_SETS if k in data and k in mapped.suite]
    entries = data.get("implementations")
    for key in ("stages", *ImplementationEntry.AXES):
        if isinstance(entries, list) and any(isinstance(e, dict) and key in e for e in entries):
            both.append(f"{key} (of an implementation entry)")
    if both:
        raise UsageError(f"{source}: {', '.join(both)} set by both the suite and {named}; keep one")
    out = {k: v for k, v in data.items() if k != "deepspeed_config"}
    out.update({k: v for k, v in mapped.suite.items() if k != "stage"})
    out["deepspeed_config"] = DeepSpeedSource(
        path=str(path),
        stage=mapped.suite["stage"],
        settings=mapped.settings,
        deepspeed_only=mapped.deepspeed_only,
        not_applied_by_deepspeed=mapped.not_applied_by_deepspeed,
    )
    return out


class SuiteConfig(_Frozen):
    """The validated content of a suite file."""

    name: str = "suite"
    description: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    models: Annotated[list[str], BeforeValidator(_as_list)] = Field(min_length=1)
    implementations: Annotated[list[ImplementationEntry], BeforeValidator(_implementation_entries)] = Field(
        min_length=1
    )
    world_sizes: Annotated[list[WorldSize], BeforeValidator(_as_list)] = Field(min_length=1)
    """Ranks per case; ``auto`` is every local GPU, or 2 ranks on CPU (resolved when the suite is prepared)."""
    precisions: Annotated[list[Precision], BeforeValidator(_as_list)] = ["fp32"]
    offload: Annotated[list[Offload], BeforeValidator(_as_list)] = ["none"]
    activation_checkpointing: Annotated[list[bool], BeforeValidator(_as_list)] = [False]
    """Axis: recompute each transformer block's activations in backward (the harness applies it the same way for
    every implementation, to every block of ``model.blocks``)."""
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
    price_per_gpu_hour: float | None = Field(None, gt=0)
    """What one GPU (one rank, on CPU) costs per hour, in any currency: each case then shows its cost per step
    and per million tokens."""
    regression: RegressionConfig = RegressionConfig()
    keep_params: bool = False
    """Keep each case's final-parameter file after its equivalence verdict is stored (default: deleted)."""
    paired_rounds: int = Field(20, ge=0)
    """After each case trains, this many rounds of one step of it and one of a DDP copy of its model, alternating:
    the step-time ratios ``zbench check`` gates on, which cancel the machine's drift (docs/methods.md#regression-gate);
    0: none, the gate falls back to absolute step times."""
    paired_seconds: float = Field(0.0, ge=0)
    """...and more paired rounds until this many seconds have passed (at least ``paired_rounds``): on a loaded
    CPU machine each ratio is noisy and the gate needs hundreds of rounds to see 10% (docs/methods.md)."""
    deepspeed_config: DeepSpeedSource | None = None
    """A DeepSpeed JSON config (path, relative to the suite file) whose settings the suite trains: DeepSpeed gets
    it whole, every other implementation what corresponds, each case listing what it does not apply."""
    noise_twin: bool = True
    """Run each DDP reference twice, the second time with its batch split another way, to measure the noise floor
    the equivalence bounds scale with (docs/methods.md#equivalence); off: fixed bounds."""
    fp32_probe: bool = True
    """Each bf16 or fp16 case also trains in fp32 after its run, in the same processes, and is judged on that too,
    with the fp32 bounds (docs/methods.md#bf16-verdicts): bf16's noise hides logic bugs that fp32 catches. The
    fp32 DDP reference and twin it is judged against are added to the suite when it has no fp32 cases."""
    fp32_probe_steps: int | None = Field(20, ge=1)
    """The fp32 probe trains this many steps (the case's own when it has fewer; null: all of them), so that its
    cost stays a small part of a long case's: the fp32 reference and twin also keep their parameters after that
    step, which the probe's are judged against. 20 steps hold every bug of the wrong-implementation matrix
    (the latest starts at step 10); a bug that starts later is the bf16 run's own checks' to catch."""
    profile: ProfileConfig | None = None
    """Record a Chrome trace of these steps on every rank (``profile: {steps: [5, 6]}``); the profiler slows them,
    so they are left out of the step-time statistics."""

    @field_validator("models")
    @classmethod
    def _known_models(cls, models: list[str]) -> list[str]:
        for m in models:  # a builder's path is imported, and a config file read, by the preflight
            check_model_name(m)
        return models

    @model_validator(mode="after")
    def _consistent(self) -> SuiteConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be less than steps ({self.steps})")
        if self.profile is not None:
            self._check_profiled_steps(self.profile.steps)
        if self.seq_len is not None:
            for m in (m for m in self.models if m in PRESETS):  # a builder's model: checked by the preflight
                if self.seq_len > PRESETS[m].seq:
                    raise ValueError(f"seq_len {self.seq_len} exceeds model {m!r}'s context {PRESETS[m].seq}")
        return self

    def _check_profiled_steps(self, profiled: list[int]) -> None:
        """Every profiled step is one the suite runs, and at least one timed step is left unprofiled."""
        outside = [s for s in profiled if s >= self.steps]
        if outside:
            raise ValueError(
                f"profile.steps {outside} outside the suite's steps 0..{self.steps - 1} (steps count from 0)"
            )
        if set(range(self.warmup_steps, self.steps)) <= set(profiled):
            raise ValueError(
                f"profile.steps {profiled} leave no step to time after the {self.warmup_steps} warm-up steps"
            )


@dataclass(frozen=True)
class SuiteFile:
    """A validated suite and where it came from (``path`` is ``None`` for suites built from flags)."""

    path: str | None
    sha256: str
    config: SuiteConfig


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
    elif loc and loc[0] == "profile":
        model = ProfileConfig
    return list(model.model_fields)


def from_dict(data: Any, *, source: str = "suite", base: Path | None = None) -> SuiteConfig:
    """Validate a suite given as a mapping (paths in it relative to ``base``, default the working directory);
    every problem is a ``UsageError`` naming ``source``."""
    if not isinstance(data, dict):
        raise UsageError(f"{source}: a suite must be a YAML mapping of keys to values, got {type(data).__name__}")
    data = _with_deepspeed_config(data, base or Path.cwd(), source)
    try:
        return SuiteConfig(**data)
    except ValidationError as exc:
        raise UsageError(format_validation_error(source, exc)) from None
    except TypeError as exc:  # non-string keys
        raise UsageError(f"{source}: {exc}") from None


def with_overrides(data: dict[str, Any], overrides: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``data`` (a suite file's mapping) with each dotted key of ``overrides`` set to its value: ``zbench run
    --set KEY=VALUE``, exactly as if the file said it (``--set world_sizes=[2]``, ``--set optimizer.lr=0.01``
    for a key inside a mapping)."""
    out = dict(data)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = out
        for depth, key in enumerate(parents):
            child = node.get(key)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                where = ".".join(parents[: depth + 1])
                raise UsageError(f"{source}: --set {dotted}: {where} is not a mapping (it is {child!r})")
            node[key] = child = dict(child)
            node = child
        node[leaf] = value
    return out


def read(path: str | Path, overrides: Mapping[str, Any] | None = None) -> SuiteFile:
    """Read and validate a suite file, with ``--set`` ``overrides`` (dotted keys, ``zbench.suite.selection``) applied
    first; every problem is a ``UsageError`` naming the file."""
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
        if overrides:
            data = with_overrides(data, overrides, str(path))
    config = from_dict(data, source=str(path), base=path.parent)
    digest = hashlib.sha256(raw)
    if overrides:  # a run with overrides trains something else than the file alone
        digest.update(json.dumps(dict(overrides), sort_keys=True, default=str).encode())
    if config.deepspeed_config is not None:  # the config file is part of what the suite trains
        digest.update(json.dumps(config.deepspeed_config.settings, sort_keys=True).encode())
    return SuiteFile(path=str(path), sha256=digest.hexdigest(), config=config)


def from_flags(config: SuiteConfig) -> SuiteFile:
    """A suite built from command-line flags (``zbench compare``, ``zbench.testing``): hashed by its content."""
    return SuiteFile(path=None, sha256=hashlib.sha256(config.model_dump_json().encode()).hexdigest(), config=config)
