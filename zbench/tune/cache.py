"""Traces kept on disk between ``zbench tune`` runs, so a second question about the same model costs no tracing.

A trace is keyed by everything that can change it: the setup (implementation, stage, offload, ranks, precision,
micro-batch, accumulation, sequence, checkpointing, options, optimizer settings, fake device), the model (a
transformers architecture's whole config and the transformers version, a builder's module source, a preset's
configuration), the torch version, and the content of zbench's and the reference engine's Python source and
shipped architecture configs (an edited engine traces anew; a version string would not notice). One JSON file
per trace, written whole or not at all.

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
    """A digest of every Python source and JSON file (the shipped architecture configs) of zbench and of the
    reference engine (``implementations/``)."""
    package = Path(zbench.__file__).parent  # zbench/implementations links to the engine's directory: followed
    sources = sorted(
        Path(folder, name) for folder, _, names in os.walk(package, followlinks=True) for name in names
        if name.endswith((".py", ".json"))
    )  # fmt: skip
    digest = hashlib.sha256()
    for path in sources:
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@cache
def model_digest(name: str) -> str:
    """What a model's trace depends on beyond its name: a transformers architecture's whole config and the
    transformers version that builds it, a builder's module source, a preset's configuration (in the code).
    Kept per name for the process: ``trace_key`` asks for it several times per setup (each cut, the cache's get and
    put), and a model's files are read once per process elsewhere too (``hf_models.arch``)."""
    from zbench.cases import hf_models
    from zbench.cases.model_names import is_builder_path
    from zbench.cases.user_import import import_user_module
    from zbench.depth import split_depth
    from zbench.presets import preset

    base, _ = split_depth(name)
    if hf_models.is_hf_model(base):
        import transformers

        what = json.dumps(hf_models.arch(name).config, sort_keys=True) + transformers.__version__
    elif is_builder_path(base):
        module = import_user_module(base.partition(":")[0])
        what = Path(module.__file__ or "").read_text() if module.__file__ else repr(parameter_shapes(name))
    else:
        what = repr(preset(name)) + repr(parameter_shapes(name))
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def trace_key(case: Case) -> str:
    """Everything a trace depends on; the training settings ``make_case`` fixes are in it too, so a change there
    cannot serve an old trace."""
    what = {
        "model": case.model,
        "model_digest": model_digest(case.model),
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
        "optimizer": [case.optimizer, case.lr, case.weight_decay, case.momentum, case.grad_clip, case.steps],
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
