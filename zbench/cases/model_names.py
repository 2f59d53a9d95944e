"""What a model name can be, checked without torch or transformers: the suite parser's first look at ``models``.

A preset (``small``), a published architecture (``llama-3.1-8b``, ``zbench.cases.hf_models``), a local
transformers ``config.json``, or a builder of the user's (``my_pkg.models:build``, ``zbench.cases.model_source``).
"""

from __future__ import annotations

from zbench.cases import hf_models
from zbench.depth import split_depth
from zbench.presets import PRESETS

KINDS = "a preset, a published architecture (zbench list), path/to/config.json, or module:builder (your own)"


class ModelSourceError(ValueError):
    """A model name that is neither a preset, a published architecture nor a usable builder; one line."""


def is_builder_path(name: str) -> bool:
    return ":" in name


def check_model_name(name: str) -> None:
    """One line if ``name`` is none of the kinds a model can be (without importing a builder or reading a file)."""
    try:
        base, blocks = split_depth(name)
    except ValueError as exc:
        raise ModelSourceError(str(exc)) from None
    if blocks is not None and is_builder_path(base):
        raise ModelSourceError(f"model {name!r}: a builder's model cannot be cut to {blocks} blocks")
    if not (is_builder_path(base) or base in PRESETS or hf_models.is_hf_model(base)):
        raise ModelSourceError(f"unknown model {name!r}; allowed: {KINDS}")
