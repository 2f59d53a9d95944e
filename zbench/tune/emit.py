"""What ``zbench tune`` hands on: its chosen setups as a suite ``zbench run`` takes (``--emit-suite``, and what
``--verify`` runs), and a chosen DeepSpeed setup as a DeepSpeed JSON config (``--emit-deepspeed``).

A suite of chosen setups is a list of implementation entries, each one setup with its own offload, micro-batch,
accumulation and checkpointing (``zbench.suite.config.ImplementationEntry``), so that ``zbench run`` trains
exactly the setups ranked, each against a DDP case trained the same way. What is written is validated as a suite
first: a file ``zbench tune`` writes is one ``zbench run`` reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import yaml

from zbench.atomic import atomic_write_bytes
from zbench.cases.case import Case
from zbench.errors import UsageError
from zbench.implementations.deepspeed_zero import deepspeed_config
from zbench.suite import config as suite_config
from zbench.tune.space import Question

#: Keys of the harness's own DeepSpeed config that only make sense under zbench (its client optimizer, its quiet
#: logs): a config handed to a user's training script goes without them, with DeepSpeed's own optimizer section.
HARNESS_ONLY = ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print")


def entry(case: Case) -> dict[str, Any]:
    """One setup as a suite's implementation entry."""
    out: dict[str, Any] = {"name": case.implementation, "stages": [case.stage], "offload": [case.offload]}
    out["micro_batch"] = case.micro_batch
    out["grad_accum"] = case.grad_accum
    out["activation_checkpointing"] = [case.activation_checkpointing]
    if case.options:
        out["options"] = dict(case.options)
    return out


def suite_document(
    q: Question, cases: list[Case], *, device: str, steps: int = 20, warmup_steps: int = 3, **settings: Any
) -> dict[str, Any]:
    """A suite training ``cases`` (setups of ``q``, in their order) on ``device``; ``settings``: other suite keys."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"tune-{q.model}-{q.gpus}")
    return {
        "name": name,
        "description": f"setups zbench tune chose for {q.model} on {q.gpus} ranks",
        "device": device,
        "models": [q.model],
        "world_sizes": [q.gpus],
        "precisions": [q.precision],
        "seq_len": q.seq_len,
        "steps": steps,
        "warmup_steps": warmup_steps,
        **settings,
        "implementations": [entry(c) for c in cases],
    }


def suite_text(document: dict[str, Any], header: list[str]) -> str:
    """The suite as YAML under a comment ``header`` (where it came from, what was predicted), checked to be a
    suite ``zbench run`` accepts."""
    suite_config.from_dict(document, source="the emitted suite")
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header)
    return comments + yaml.safe_dump(document, sort_keys=False, default_flow_style=None, width=120)


def write(path: Path, text: str) -> None:
    """Write an emitted file whole, or say in one line why it cannot be."""
    try:
        atomic_write_bytes(path, text.encode())
    except OSError as exc:
        raise UsageError(f"{path}: cannot write: {exc.strerror or exc}") from None


def deepspeed_document(case: Case, *, on_gpu: bool) -> dict[str, Any]:
    """``case`` (a DeepSpeed setup) as the DeepSpeed config a training script hands ``deepspeed.initialize``: the
    one zbench trains it with (``deepspeed_config``) on a GPU (``on_gpu``: offloaded state in pinned memory) or a
    CPU, with the batch DeepSpeed checks the world against, and DeepSpeed's own optimizer section (a suite's
    default optimizer: set your own) in place of zbench's client optimizer."""
    spec = case.train_spec(torch.device("cuda" if on_gpu else "cpu"))
    out = {k: v for k, v in deepspeed_config(spec, case.micro_batch).items() if k not in HARNESS_ONLY}
    out["train_batch_size"] = case.global_batch
    default = suite_config.OptimizerConfig()
    params: dict[str, Any] = {"lr": default.lr, "weight_decay": default.weight_decay}
    out["optimizer"] = {"type": {"adamw": "AdamW", "sgd": "SGD"}[default.name], "params": params}
    return out


def deepspeed_text(case: Case, *, on_gpu: bool) -> str:
    return json.dumps(deepspeed_document(case, on_gpu=on_gpu), indent=2) + "\n"
