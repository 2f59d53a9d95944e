"""Cluster profiles for ``zbench plan --simulate``: one YAML file per kind of node, read and checked here.

A profile says what the step-time model (``zbench.plan.simulate.step``) needs about a cluster: the GPU's peak and
the share of it a transformer step reaches, the links inside a node and between nodes (bus bandwidth per GPU
and per-hop latency, the alpha and beta of the alpha-beta model), the host link and the NVMe drives. The
built-in profiles live beside this module (``clusters/*.yaml``); a user's file is given by its path.

Profiles carry a schema version (``schema_version``; a file without one is version 1, the first layout, and
loads as it always did). Version 2 adds ``sources`` (where each figure comes from: a datasheet, a published
microbenchmark, an assumption, or a measurement) and, in profiles ``zbench calibrate`` writes, ``calibration``
(the measured tables the figures were derived from, ``zbench.plan.simulate.calibration``). Version 3 adds
``operators`` (published operator rates a datasheet profile charges each traced operator from,
``zbench.plan.simulate.datasheet``). Version 4 keeps each implementation probe's measured step beside its
residual (``ImplementationOverhead.measured_us``), a wide probe's among them. Version 5 adds each operator's
factor inside a training step (``Calibration.operator_factors``). Version 6 adds each implementation's host work per
parameter element beyond DDP's (``ImplementationOverhead.per_element_us``), read off the wide probe. Version 7
adds each probe step's time outside its recorded operators (``Calibration.step_residuals``). Version 8 replaces the
one thread speed-up (an fp32 MLP's) with each probe step's, by dtype (``Calibration.thread_speedups``). Version 9
adds each probe step's slow-down while the other cores run it too (``Calibration.corun_slowdowns``).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from zbench.plan.simulate.calibration import Calibration, CollectiveCurve
from zbench.plan.simulate.datasheet import DatasheetOperators, DatasheetRates

BUILT_IN = Path(__file__).with_name("clusters")

#: The newest profile layout this zbench reads and writes (the module docstring says what each adds).
SCHEMA_VERSION = 9


class Link(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_gb_s: float = Field(gt=0, description="bus bandwidth per GPU, GB/s (10^9 bytes), per direction")
    latency_us: float = Field(ge=0, description="per step of a ring or tree, microseconds")


class Cluster(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    gpu: str
    peak_tflops: float = Field(gt=0, description="dense peak at the training precision, 10^12 FLOP/s")
    memory_gib: float = Field(gt=0)
    efficiency: float = Field(gt=0, le=1, description="share of the peak a step's compute reaches")
    gpus_per_node: int = Field(ge=1)
    intra_node: Link
    inter_node: Link
    pcie_gb_s: float = Field(gt=0, description="host <-> GPU, per GPU")
    nvme_gb_s_per_node: float = Field(gt=0)
    host_adam_params_per_s: float = Field(gt=0, description="host optimizer speed per GPU's share of the cores")
    overlap: float = Field(
        default=1.0, ge=0, le=1, description="share of overlappable communication that runs beside compute"
    )
    schema_version: int = Field(default=1, ge=1, description="the profile layout; files without one are version 1")
    sources: dict[str, str] = Field(
        default_factory=dict, description="figure name -> where it comes from (datasheet, microbenchmark, ...)"
    )
    calibration: Calibration | None = Field(default=None, description="what `zbench calibrate` measured")
    operators: DatasheetOperators | None = Field(
        default=None, description="published operator rates, for a profile without a calibration"
    )

    def compute_model(self) -> str:
        """Which compute model this profile's predictions use: ``calibrated`` (the calibration's tables),
        ``datasheet`` (the published operator rates) or ``efficiency`` (the FLOPs at ``efficiency`` of the peak)."""
        if self.calibration is not None:
            return "calibrated"
        return "datasheet" if self.operators is not None else "efficiency"

    def on_cpu(self) -> bool:
        """Whether the profile's "GPUs" are CPU cores (a calibration of a CPU, or a CPU profile like cpu-2core)."""
        if self.calibration is not None:
            return self.calibration.device == "cpu"
        return self.gpu.lower().startswith("cpu")

    def backend(self) -> str | None:
        """The collective backend its links were calibrated over (gloo, nccl); None for a profile measured nowhere."""
        return self.calibration.backend if self.calibration is not None else None

    def operator_rates(self) -> Calibration | DatasheetRates | None:
        """What each traced operator is charged from, as ``compute_model`` says; None for ``efficiency``."""
        model = self.compute_model()
        if model == "calibrated":
            return self.calibration
        if model != "datasheet" or not self.operators:
            return None
        return self.operators.rates("cpu" if self.on_cpu() else self.gpu)  # the step model reads "cpu" as the host

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version > SCHEMA_VERSION:
            raise ValueError(f"version {version} is newer than this zbench reads ({SCHEMA_VERSION}): upgrade zbench")
        return version

    @field_validator("sources")
    @classmethod
    def _known_figures(cls, sources: dict[str, str]) -> dict[str, str]:
        """A source names a figure of the profile (``peak_tflops``, or ``intra_node.latency_us`` for part of one)."""
        unknown = sorted(name for name in sources if name.split(".")[0] not in cls.model_fields)
        if unknown:
            raise ValueError(f"sources name figures the profile does not have: {', '.join(unknown)}")
        return sources

    def nodes(self, world: int) -> int:
        return math.ceil(world / self.gpus_per_node)

    def curve(self, op: str, world: int) -> CollectiveCurve | None:
        """The calibration's measured curve of ``op`` over exactly ``world`` ranks, if it has one."""
        if self.calibration is None:
            return None
        return next((c for c in self.calibration.collectives if c.op == op and c.ranks == world), None)

    def bandwidth(self, world: int) -> float:
        """Bus bandwidth (bytes/s) of a collective over ``world`` ranks: its slowest link."""
        gb_s = self.intra_node.bandwidth_gb_s
        if self.nodes(world) > 1:
            gb_s = min(gb_s, self.inter_node.bandwidth_gb_s)
        return gb_s * 1e9

    def ring_latency(self, world: int) -> float:
        """Seconds of latency for one pass around a ring of ``world`` ranks: one hop per rank, one per node
        boundary over the network."""
        nodes = self.nodes(world)
        inter_hops = nodes if nodes > 1 else 0
        return ((world - 1 - inter_hops) * self.intra_node.latency_us + inter_hops * self.inter_node.latency_us) * 1e-6

    def tree_latency(self, world: int) -> float:
        """Seconds of latency down (or up) a tree: log2 levels inside a node, log2 levels across nodes."""
        inside = math.ceil(math.log2(min(world, self.gpus_per_node)))
        across = math.ceil(math.log2(self.nodes(world)))
        return (inside * self.intra_node.latency_us + across * self.inter_node.latency_us) * 1e-6


class ClusterError(ValueError):
    """A profile that cannot be read; the message is one line."""


def built_in_names() -> list[str]:
    return sorted(p.stem for p in BUILT_IN.glob("*.yaml"))


def load(name_or_path: str) -> Cluster:
    """A built-in profile by name (``h100-sxm``) or a YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = BUILT_IN / f"{name_or_path}.yaml"
        if not path.exists():
            raise ClusterError(f"unknown cluster {name_or_path!r}; built-in: {', '.join(built_in_names())}, or a file")
    try:
        data = yaml.safe_load(path.read_text())
        return Cluster.model_validate(data)
    except OSError as exc:
        raise ClusterError(f"cluster file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ClusterError(f"cluster file {path}: not YAML ({str(exc).splitlines()[0]})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ClusterError(f"cluster file {path}: {where}: {first['msg']}") from None
