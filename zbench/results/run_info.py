"""The stored run header (``results/<run-id>/run.json``): which suite ran, where, from which commit, and when."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from zbench.results.record import SCHEMA_VERSION


class Environment(BaseModel):
    """What ``zbench env`` reports; extra keys (newer zbench, other backends) are kept as they are."""

    model_config = ConfigDict(extra="allow")

    zbench_version: str | None = None
    git_sha: str | None = None
    python: str | None = None
    torch: str | None = None
    platform: str | None = None
    host: str | None = None
    cpu_count: int | None = None
    load_average_1m: float | None = None
    """The machine's one-minute load average when the run started (others' work competes for its cores)."""
    backends: dict[str, bool] = Field(default_factory=dict)
    cuda_available: bool = False
    cuda_version: str | None = None
    nccl_version: str | None = None
    gpu_count: int = 0
    gpus: list[str] = Field(default_factory=list)
    nvml: dict[str, Any] = Field(default_factory=dict)
    interconnect: dict[str, Any] = Field(default_factory=dict)
    """What links this machine's GPUs to each other and to other nodes, as nvml and the system report it:
    NVLink links up per GPU, InfiniBand devices, and the ``NCCL_*`` settings in the environment."""


class SuiteInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    path: str | None = None
    sha256: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    """The validated suite as it was run (``SuiteConfig.model_dump()``)."""

    @property
    def regression(self) -> dict[str, float]:
        """The suite's own ``regression:`` thresholds (empty: the defaults)."""
        return dict(self.config.get("regression") or {})

    @property
    def warmup_steps(self) -> int | None:
        return self.config.get("warmup_steps")


class RunInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    run_id: str
    suite: SuiteInfo
    environment: Environment = Field(default_factory=Environment)
    nodes: list[Environment] = Field(default_factory=list)
    """Every node's environment, node 0's first, when the run spanned several nodes (empty on one node)."""
    git_sha: str | None = None
    case_order: list[str] = Field(default_factory=list)
    started_at: str = ""
    ended_at: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return {**self.model_dump(mode="json"), "schema_version": SCHEMA_VERSION}

    @classmethod
    def read(cls, path: Path) -> RunInfo:
        return cls.model_validate(json.loads(Path(path).read_text()))
