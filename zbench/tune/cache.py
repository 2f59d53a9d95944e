"""Traces kept on disk between ``zbench tune`` runs, so a second question about the same model costs no tracing.

A trace is keyed by everything that can change it: the setup (model and its parameter shapes, implementation,
stage, offload, ranks, precision, micro-batch, accumulation, sequence, checkpointing, options, fake device), the
torch version, and the content of zbench's and the reference engine's source (an edited engine traces anew; a
version string would not notice). One JSON file per trace, written whole or not at all.

Where: ``$ZBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/zbench``, else ``~/.cache/zbench``; ``traces/`` under it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from functools import cache
from pathlib import Path

import torch

import zbench
from zbench.atomic import atomic_write_json
from zbench.cases.case import Case
from zbench.cases.model_source import parameter_shapes
from zbench.plan.trace.tracer import TraceResult


def cache_root() -> Path:
    if env := os.environ.get("ZBENCH_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zbench"


@cache
def code_digest() -> str:
    """A digest of every Python source of zbench and of the reference engine (``implementations/``)."""
    package = Path(zbench.__file__).parent  # zbench/implementations links to the engine's directory: followed
    sources = sorted(
        Path(folder, name) for folder, _, names in os.walk(package, followlinks=True) for name in names
        if name.endswith(".py")
    )  # fmt: skip
    digest = hashlib.sha256()
    for path in sources:
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def trace_key(case: Case) -> str:
    what = {
        "model": case.model,
        "shapes": hashlib.sha256(repr(parameter_shapes(case.model)).encode()).hexdigest()[:16],
        "implementation": case.implementation,
        "stage": case.stage,
        "offload": case.offload,
        "world": case.world_size,
        "precision": case.precision,
        "micro_batch": case.micro_batch,
        "grad_accum": case.grad_accum,
        "seq_len": case.seq_len,
        "checkpointing": case.activation_checkpointing,
        "options": case.options,
        "device": case.device,
        "torch": torch.__version__,
        "code": code_digest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


class TraceCache:
    """Traces by ``trace_key`` under ``root`` (``cache_root()/traces`` unless given)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_root() / "traces"

    def _path(self, case: Case) -> Path:
        return self.root / f"{trace_key(case)}.json"

    def get(self, case: Case) -> TraceResult | None:
        """The stored trace, or None when absent or unreadable (a file from another layout traces anew)."""
        path = self._path(case)
        try:
            data = json.loads(path.read_text())
            names = {f.name for f in fields(TraceResult)}
            return TraceResult(**{k: v for k, v in data.items() if k in names})
        except (OSError, ValueError, TypeError):
            return None

    def put(self, case: Case, trace: TraceResult) -> None:
        """Store a trace; a failed trace is not stored (its cause may be passing, e.g. memory)."""
        if trace.error:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self._path(case), trace.to_json())
