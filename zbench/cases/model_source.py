"""Where a suite's model comes from: a preset name (``small``), a published architecture (``llama-3.1-8b``, or a
local ``config.json``: ``zbench.cases.hf_models``) or a builder of the user's (``my_pkg.models:build``).

The contract for a builder (docs/methods.md#models-users-bring):

- ``build(seed: int) -> torch.nn.Module``, deterministic in ``seed``: every rank calls it and must get the
  same initial weights (the harness seeds torch's CPU generator with ``seed`` before the call, builds on
  the CPU and then moves the module to the rank's device);
- ``module(idx, targets)`` returns the scalar mean loss, where ``idx`` and ``targets`` are
  ``[micro_batch, seq_len]`` int64 token ids and ``targets`` is ``idx`` shifted by one: the harness's
  synthetic next-token data, the same for every implementation;
- ``module.vocab_size`` (ids are drawn below it) and ``module.max_seq_len`` (the longest ``seq_len`` the
  suite may ask for) say what data it needs;
- optional ``module.blocks`` (an ``nn.ModuleList``): the units activation checkpointing wraps and the
  stage-3 engines shard one by one; without it, checkpointing refuses and stage 3 gathers the model whole;
- optional ``module.unused_parameters = True``: some parameters may get no gradient in a step (experts no token
  was routed to); DDP then finds them and the sharded engines treat them as it does (docs/methods.md).

Presets describe themselves with a ``GPTConfig``; a user model is measured once, on the ``meta`` device
(no memory, no weights), for its parameter count and data shape. Its model FLOPs are the usual
``6 x parameters`` per token (no attention term: the harness does not know its architecture).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, TypeVar

from zbench.cases import hf_models
from zbench.cases.hf_models import HFArch, HFModelError
from zbench.cases.model_names import ModelSourceError, check_model_name, is_builder_path
from zbench.cases.user_import import import_user_module
from zbench.presets import GPTConfig, preset

if TYPE_CHECKING:  # torch is imported lazily: the suite parser uses this module without it
    import torch
    from torch import nn

    from zbench.protocol import ModelShape


_T = TypeVar("_T")


@dataclass(frozen=True)
class ModelInfo:
    """What the harness needs to know about a model without building it on a device."""

    name: str
    parameters: int
    vocab: int
    seq: int
    """The longest sequence the model takes (the suite's ``seq_len`` defaults to it)."""
    gpt: GPTConfig | None = None
    """The preset's configuration; ``None`` for any other model."""
    has_blocks: bool = True
    """It has a ``blocks`` ``nn.ModuleList`` (what activation checkpointing wraps)."""
    arch: HFArch | None = None
    """A published architecture's (or local config's) description; ``None`` for the others."""
    block_sizes: tuple[int, ...] = ()
    """Elements each of its ``blocks`` holds alone, in order (empty without blocks)."""
    shared_block_parameters: int = 0
    """Elements two or more of its blocks share (and the root does not)."""
    unused_parameters: bool = False
    """Some parameters may get no gradient in a step (``module.unused_parameters``: experts no token reached)."""

    @property
    def shape(self) -> ModelShape:
        """What an implementation may know of the model (its traffic is declared against it), for every kind of
        model alike."""
        from zbench.protocol import ModelShape  # imports torch: only the ranks and the planner ask

        return ModelShape(
            parameter_sizes(self.name),
            self.block_sizes,
            self.shared_block_parameters,
            parameter_shapes=parameter_shapes(self.name),
        )

    @property
    def default_seq_len(self) -> int:
        """The suite's ``seq_len`` when it names none: a published architecture's training length, else ``seq``."""
        return self.arch.train_seq_len if self.arch else self.seq

    def flops_per_token(self, seq: int | None = None) -> float:
        """Training FLOPs per token: a preset's or an architecture's count with attention, else ``6 x parameters``."""
        if self.arch:
            return self.arch.flops_per_token(seq)
        return self.gpt.flops_per_token(seq) if self.gpt else 6.0 * self.parameters


def load_builder(path: str) -> Callable[[int], object]:
    """The callable at ``module:attribute``, or a one-line ``ModelSourceError``."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ModelSourceError(f"model {path!r}: expected a preset name or module:builder")
    try:
        module = import_user_module(module_name)
    except Exception as exc:  # any import failure is the user's path or module: one line, not a traceback
        raise ModelSourceError(f"model {path!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    builder = getattr(module, attr, None)
    if not callable(builder):
        raise ModelSourceError(f"model {path!r}: {module_name!r} has no callable {attr!r}")
    return builder


def _seeded_on_cpu(make: Callable[[], _T], *, seed: int, device: torch.device | str) -> _T:
    """``make()`` with torch's CPU generator seeded with ``seed``, its tensors made on the CPU (on ``meta`` when
    ``device`` is): the same initial weights on every rank and every host."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("meta" if str(device) == "meta" else "cpu"):
            return make()


def _moved(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A model built by ``_seeded_on_cpu``, on ``device`` (``meta`` stays where it was built)."""
    if str(device) == "meta":
        return model
    from zbench.cases.models import to_device

    return to_device(model, device)


def build_user_model(path: str, *, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Call the builder with torch's CPU generator seeded, on the CPU (or ``meta``), and check what it returns."""
    from torch import nn

    builder = load_builder(path)
    model = _seeded_on_cpu(lambda: builder(seed), seed=seed, device=device)
    if not isinstance(model, nn.Module):
        raise ModelSourceError(f"model {path!r}: the builder returned {type(model).__name__}, not a torch.nn.Module")
    for attr in ("vocab_size", "max_seq_len"):
        if not isinstance(getattr(model, attr, None), int):
            raise ModelSourceError(
                f"model {path!r}: the module has no int {attr!r} (the data it needs; see docs/methods.md)"
            )
    return _moved(model, device)


def _declared_int(model: nn.Module, attr: str) -> int:
    """An int the module declares about its data (checked by ``build_user_model``)."""
    value = getattr(model, attr, None)
    if not isinstance(value, int):
        raise ModelSourceError(f"model attribute {attr!r} is not an int")
    return value


@cache
def model_info(name: str) -> ModelInfo:
    """A preset's or a published architecture's figures (no torch), or a user model's measured on ``meta``."""
    check_model_name(name)
    if (cfg := preset(name)) is not None:
        return ModelInfo(
            name,
            cfg.num_parameters,
            cfg.vocab,
            cfg.seq,
            gpt=cfg,
            block_sizes=cfg.block_sizes,
            unused_parameters=cfg.experts > 0,
        )
    if hf_models.is_hf_model(name):
        try:
            spec = hf_models.arch(name)
        except HFModelError as exc:
            raise ModelSourceError(str(exc)) from None
        return ModelInfo(
            name, spec.num_parameters, spec.vocab, spec.max_positions, arch=spec, block_sizes=spec.block_sizes
        )
    import torch

    try:
        model = build_user_model(name, seed=0, device="meta")
    except ModelSourceError:
        raise
    except Exception as exc:  # the builder's own failure, reported in one line
        raise ModelSourceError(f"model {name!r}: the builder failed ({type(exc).__name__}: {exc})") from None
    has_blocks = isinstance(getattr(model, "blocks", None), torch.nn.ModuleList)
    block_sizes, shared = _block_layout(model) if has_blocks else ((), 0)
    return ModelInfo(
        name,
        sum(math.prod(shape) for shape in _distinct_shapes(model)),
        _declared_int(model, "vocab_size"),
        _declared_int(model, "max_seq_len"),
        gpt=None,
        has_blocks=has_blocks,
        block_sizes=block_sizes,
        shared_block_parameters=shared,
        unused_parameters=bool(getattr(model, "unused_parameters", False)),
    )


def check_buildable(info: ModelInfo) -> None:
    """What building ``info``'s model needs and this environment lacks (transformers, for a published
    architecture), as one ``ModelSourceError``; its figures alone (``model_info``) need nothing."""
    if info.arch is not None and (missing := hf_models.missing_transformers()):
        raise ModelSourceError(f"{info.name!r} {missing}")


@cache
def parameter_shapes(name: str) -> tuple[tuple[int, ...], ...]:
    """Shape of each distinct parameter, in ``parameters()`` order (a user's model measured on ``meta``): for
    layouts that depend on single tensors (DeepSpeed keeps parameters below a size unpartitioned; FSDP2 splits each
    by rows, the first rank taking the odd row)."""
    if (cfg := preset(name)) is not None:
        return cfg.parameter_shapes
    if hf_models.is_hf_model(name):
        return hf_models.arch(name).parameter_shapes
    return _distinct_shapes(build_user_model(name, seed=0, device="meta"))


def parameter_sizes(name: str) -> tuple[int, ...]:
    """Elements of each distinct parameter, in ``parameters()`` order."""
    return tuple(math.prod(shape) for shape in parameter_shapes(name))


def _block_layout(model: nn.Module) -> tuple[tuple[int, ...], int]:
    """Elements each of ``model.blocks`` holds alone, and those two or more blocks share (``ModelShape``): a weight
    the root also holds (a tied head) is the root's alone."""
    from zbench.protocol import root_held  # imports torch, which a model at hand has imported already

    modules = list(model.get_submodule("blocks").children())
    in_root = root_held(model, modules)
    blocks = [list(block.parameters()) for block in modules]
    holders = Counter(id(p) for params in blocks for p in params if id(p) not in in_root)
    own = tuple(sum(p.numel() for p in params if holders[id(p)] == 1) for params in blocks)
    shared = {id(p): p.numel() for params in blocks for p in params if holders[id(p)] > 1}
    return own, sum(shared.values())


def _distinct_shapes(model: nn.Module) -> tuple[tuple[int, ...], ...]:
    unique = {id(p): p for p in model.parameters()}  # a shared (tied) weight counts once
    return tuple(tuple(p.shape) for p in unique.values())


def build(name: str, *, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The model every implementation of a case starts from, identical on every rank."""
    if is_builder_path(name):
        return build_user_model(name, seed=seed, device=device)
    if hf_models.is_hf_model(name):
        return _build_hf(name, seed=seed, device=device)
    from zbench.cases.models import build_model

    return build_model(name, seed=seed, device=device)


def _build_hf(name: str, *, seed: int, device: torch.device | str) -> nn.Module:
    """A published architecture built by transformers (``zbench.cases.hf_adapter``), initialised from ``seed``
    on the CPU (identical on every rank), then moved."""
    spec = hf_models.arch(name)
    if missing := hf_models.missing_transformers():
        raise ModelSourceError(f"model {name!r} {missing}")
    from zbench.cases.hf_adapter import build as build_transformers_model

    model = _seeded_on_cpu(
        lambda: build_transformers_model(spec.config, max_seq_len=spec.max_positions), seed=seed, device=device
    )
    return _moved(model, device)
