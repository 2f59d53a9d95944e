"""The architectures people train, by name: Llama 2 and 3.1, Mistral, Qwen2.5 and Mixtral, built with HF transformers.

Each published model is a small JSON file in ``hf_configs/``: the hyperparameters
of its ``config.json`` on the Hugging Face hub (no weights: every run starts from
a random initialisation, seeded like every other model) and the training sequence
length zbench uses by default, with why (the config's ``max_position_embeddings``
is the longest context, 131,072 for Llama 3.1, not what anyone trains at). Each
has a scaled-down twin, ``<name>-mini``: the same architecture (grouped-query
ratio, SwiGLU, RMSNorm, rotary embeddings, untied head, experts and their top-k)
in two narrow layers, for CPU runs. A local ``config.json`` works too: a model
name ending in ``.json`` (a builder's ``module:builder`` path never does).

Everything the harness needs before building (parameter count, each parameter's
size, FLOPs per token, data shape) is computed here from the config, without
transformers; ``tests/test_hf_models.py`` holds each count to what transformers
builds on the ``meta`` device. Building needs the ``hf`` extra
(``pip install 'zbench[hf]'``, transformers 5.23 is what the tests pin);
without it, one line says so.

``zbench.cases.hf_adapter`` builds the module and wraps it for the harness; this module imports neither torch
nor transformers, so that the suite parser and ``zbench list`` need neither.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).with_name("hf_configs")
MINI = "-mini"
ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral")
"""The ``model_type`` values whose layout the counts below know (transformers 5.23)."""
INSTALL_HINT = "pip install 'zbench[hf]' (transformers)"


class HFModelError(ValueError):
    """A published name or a local config that zbench cannot use; the message is one line."""


@dataclass(frozen=True)
class HFArch:
    """One decoder-only architecture from its transformers config: shapes, counts, FLOPs."""

    name: str
    config: dict[str, Any] = field(hash=False)
    train_seq_len: int

    def _get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def d_model(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self._get("num_key_value_heads") or self.heads)

    @property
    def head_dim(self) -> int:
        return int(self._get("head_dim") or self.d_model // self.heads)

    @property
    def ffn(self) -> int:
        return int(self.config["intermediate_size"])

    @property
    def experts(self) -> int:
        """Experts per layer (0: a dense MLP)."""
        return int(self._get("num_local_experts") or 0)

    @property
    def experts_per_token(self) -> int:
        return int(self._get("num_experts_per_tok") or 0)

    @property
    def tied(self) -> bool:
        return bool(self._get("tie_word_embeddings", False))

    @property
    def max_positions(self) -> int:
        return int(self.config["max_position_embeddings"])

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or bool(self._get("attention_bias", False))

    def _attention_shapes(self) -> tuple[tuple[int, ...], ...]:
        d, kv = self.d_model, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        if self.qkv_bias:
            return ((q, d), (q,), (kv, d), (kv,), (kv, d), (kv,), (d, q))
        return ((q, d), (kv, d), (kv, d), (d, q))

    def _mlp_shapes(self) -> tuple[tuple[int, ...], ...]:
        d, f, e = self.d_model, self.ffn, self.experts
        if e:  # the router, then the experts fused into 3-D tensors (transformers 5)
            return ((e, d), (e, 2 * f, d), (e, d, f))
        return ((f, d), (f, d), (d, f))  # gate, up, down

    def _mlp_sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self._mlp_shapes())

    def _layer_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One decoder layer: attention, MLP (or router and experts), input and post-attention norms."""
        return (*self._attention_shapes(), *self._mlp_shapes(), (self.d_model,), (self.d_model,))

    def _layer_sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self._layer_shapes())

    @property
    def parameter_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each distinct parameter, in ``parameters()`` order of the transformers model."""
        d = self.d_model
        head = () if self.tied else ((self.vocab, d),)
        return ((self.vocab, d), *self._layer_shapes() * self.layers, (d,), *head)

    @property
    def parameter_sizes(self) -> tuple[int, ...]:
        """Elements of each distinct parameter, in ``parameters()`` order of the transformers model."""
        return tuple(math.prod(shape) for shape in self.parameter_shapes)

    @property
    def num_parameters(self) -> int:
        return sum(self.parameter_sizes)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Parameters of each decoder layer, in order (``zbench.protocol.ModelShape``)."""
        return (sum(self._layer_sizes()),) * self.layers

    @property
    def largest_unit_parameters(self) -> int:
        """The biggest unit a stage-3 engine gathers at once: a decoder layer, the embedding or the head."""
        return max(sum(self._layer_sizes()), self.vocab * self.d_model)

    @property
    def active_parameters(self) -> int:
        """Parameters one token multiplies through, less the embedding lookup: with experts, only its top-k
        experts' share (the head counts, tied or not)."""
        expert_share = 0
        if self.experts:
            per_layer = sum(self._mlp_sizes()[1:])
            expert_share = self.layers * per_layer * (self.experts - self.experts_per_token) // self.experts
        return self.num_parameters - self.vocab * self.d_model * (0 if self.tied else 1) - expert_share

    def flops_per_token(self, seq: int | None = None) -> float:
        """Training FLOPs per token at ``seq`` (default: the training length): 6 x the parameters it
        multiplies through + attention's scores and weighted sum, 6·layers·heads·head_dim·seq (the GPT
        presets' convention, docs/methods.md)."""
        return 6.0 * self.active_parameters + 6.0 * self.layers * self.heads * self.head_dim * (
            seq or self.train_seq_len
        )

    def with_layers(self, layers: int, name: str) -> HFArch:
        """The same architecture with its first ``layers`` decoder layers (per-layer lists cut to match)."""
        changes: dict[str, Any] = {"num_hidden_layers": layers}
        if "max_window_layers" in self.config:
            changes["max_window_layers"] = min(int(self.config["max_window_layers"]), layers)
        if isinstance(self.config.get("layer_types"), list):
            changes["layer_types"] = self.config["layer_types"][:layers]
        return replace(self, name=name, config={**self.config, **changes})

    def mini(self) -> HFArch:
        """The same architecture in two narrow layers: head_dim 16, the grouped-query ratio kept, the MLP's
        width ratio kept, vocabulary 512, 128 positions; experts and their top-k as published."""
        group = max(1, self.heads // self.kv_heads)
        heads = max(4, group)
        d = heads * 16
        ffn = max(8, round(d * self.ffn / self.d_model / 8) * 8)
        changes: dict[str, Any] = {
            "hidden_size": d,
            "intermediate_size": ffn,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": heads // group,
            "vocab_size": 512,
            "max_position_embeddings": 128,
        }
        if "head_dim" in self.config:
            changes["head_dim"] = 16
        if self._get("sliding_window") and self._get("use_sliding_window", True):
            changes["sliding_window"] = 32  # a window shorter than the mini's 64 tokens, as 4,096 is at 8,192
        if "max_window_layers" in self.config:
            changes["max_window_layers"] = 2
        rope = self._get("rope_scaling")
        if isinstance(rope, dict) and "original_max_position_embeddings" in rope:
            # Llama 3.1's context extension, at the published ratio (8,192 of 131,072); transformers warns otherwise
            positions = changes["max_position_embeddings"]
            original = rope["original_max_position_embeddings"] * positions // self.max_positions
            changes["rope_scaling"] = {**rope, "original_max_position_embeddings": max(1, original)}
        return replace(self, name=self.name + MINI, config={**self.config, **changes}, train_seq_len=64)


def _load(path: Path, name: str) -> HFArch:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HFModelError(f"model {name!r}: cannot read {path} ({type(exc).__name__}: {exc})") from None
    config = data.get("transformers_config", data)  # zbench's files wrap it; a hub config.json is the config
    if not isinstance(config, dict) or config.get("model_type") not in ARCHITECTURES:
        found = config.get("model_type") if isinstance(config, dict) else None
        raise HFModelError(f"model {name!r}: model_type {found!r} is not one zbench knows ({', '.join(ARCHITECTURES)})")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "max_position_embeddings") if k not in config]  # fmt: skip
    if missing:
        raise HFModelError(f"model {name!r}: the config lacks {', '.join(missing)}")
    # zbench's files say why their length; a local config gets 4,096 tokens or its context, whichever is shorter
    train_seq = int(data.get("train_seq_len") or min(4096, int(config["max_position_embeddings"])))
    return HFArch(name, config, train_seq)


@cache
def published() -> dict[str, HFArch]:
    """Every shipped architecture and its ``-mini`` twin, by name."""
    archs = [_load(path, path.stem) for path in CONFIG_DIR.glob("*.json")]
    out: dict[str, HFArch] = {}
    for arch in sorted(archs, key=lambda a: (ARCHITECTURES.index(a.model_type), a.num_parameters)):
        out[arch.name] = arch
        out[arch.name + MINI] = arch.mini()
    return out


def is_config_path(name: str) -> bool:
    """A local transformers ``config.json`` (``path/to/config.json``): never a preset or ``module:builder``."""
    return name.endswith(".json") and ":" not in name


def is_hf_model(name: str) -> bool:
    base, _ = _split_depth(name)
    return base in published() or is_config_path(base)


def _split_depth(name: str) -> tuple[str, int | None]:
    from zbench.depth import split_depth

    try:
        return split_depth(name)
    except ValueError as exc:
        raise HFModelError(str(exc)) from None


def arch(name: str) -> HFArch:
    """The architecture of a published name or a local config file, cut to fewer layers when the name says so
    (``zbench.depth``)."""
    base, blocks = _split_depth(name)
    if blocks is not None:
        return arch(base).with_layers(blocks, name)
    if name in published():
        return published()[name]
    if is_config_path(name):
        return _local(str(Path(name).resolve()), name)
    raise HFModelError(f"unknown model {name!r}")


@cache
def _local(path: str, name: str) -> HFArch:
    if not Path(path).is_file():
        raise HFModelError(f"model {name!r}: no such config file")
    return _load(Path(path), name)


def missing_transformers() -> str | None:
    """What to install when transformers is absent ("needs transformers: pip install ..."), else None."""
    import importlib.util

    try:
        found = importlib.util.find_spec("transformers") is not None
    except ValueError:  # sys.modules["transformers"] is None: Python's way of blocking an import
        found = False
    return None if found else f"needs transformers: {INSTALL_HINT}"
