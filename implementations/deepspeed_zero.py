"""DeepSpeed's ZeRO (stages 1-3, optimizer and parameter offload), the implementation most users run today.

An optional extra (``pip install -e ".[deepspeed]"``; on CPU ``DS_BUILD_OPS=0`` installs it
without compiling kernels): without it this module still imports, and every case is
skipped with that reason. ``deepspeed`` itself is imported only when an engine is built.

Mapped onto DeepSpeed's config so that it trains as every other implementation does:

- the optimizer is the suite's own torch optimizer, handed to ``deepspeed.initialize`` (a
  client optimizer; with offload ``zero_force_ds_cpu_optimizer: false`` keeps it instead of
  DeepSpeed's CPU Adam), and DeepSpeed wraps it with its ZeRO partitioning;
- bf16 keeps bf16 parameters with fp32 master partitions, reduces and accumulates gradients
  in fp32 (``communication_data_type``, ``grad_accum_dtype``), as the reference engine does;
- gradient accumulation is DeepSpeed's (``gradient_accumulation_steps``: ``step()`` after
  each micro-batch steps the optimizer at the boundary), clipping its ``gradient_clipping``;
- offload ``optimizer`` is ``offload_optimizer: cpu``; ``optimizer+params`` adds
  ``offload_param: cpu`` (stage 3). NVMe needs DeepSpeed's async I/O kernels, which a
  ``DS_BUILD_OPS=0`` install does not have, so it is not offered;
- option ``bucket_size`` (elements) is both ``reduce_bucket_size`` and ``allgather_bucket_size``
  (default ``BUCKET_ELEMENTS``); ``overlap_comm`` (true/false) is DeepSpeed's own (its default: off
  at stages 1-2, on at stage 3); ``prefetch_size`` (elements) is ``stage3_prefetch_bucket_size``
  (DeepSpeed's default ``PREFETCH_ELEMENTS``). ``zbench tune`` searches all three (``TUNABLES``).

DeepSpeed needs ``LOCAL_RANK`` (its launcher sets it) and picks its accelerator at import:
both are set from the case before the import (``DS_ACCELERATOR=cpu`` on CPU).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from zbench.implementations.deepspeed_layout import deepspeed_layout, persistent_elements
from zbench.protocol import Capabilities, EngineBase, ImplementationBase, MicroBatch, ModelShape, TrainSpec, Tunable
from zbench.state_bytes import empty_state_bytes, moved_to_host, optimizer_tensors, storage_key, tensor_bytes
from zbench.values import optimizer_bytes_per_param

#: Where DeepSpeed's ZeRO optimizers keep the fp32 master partitions (stages 1-2, stage 1 in bf16, stage 3).
MASTER_ATTRIBUTES = ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_partitioned_groups_flat")
INSTALL_HINT = "DeepSpeed is not installed: pip install -e '.[deepspeed]' (on CPU: DS_BUILD_OPS=0 pip install ...)"
#: DeepSpeed's buckets (elements) unless the ``bucket_size`` option or the user's config says otherwise: its own
#: defaults (5e8) would allocate gigabytes for any model.
BUCKET_ELEMENTS = 50_000_000
#: DeepSpeed's own ``stage3_prefetch_bucket_size``: the elements of parameters it gathers ahead of the module that
#: runs (stage 3), what a setup without the ``prefetch_size`` option runs.
PREFETCH_ELEMENTS = 50_000_000
#: The options the adapter takes, each with the DeepSpeed ``zero_optimization`` keys it sets: a DeepSpeed config (a
#: suite's ``deepspeed_config``), then the knobs ``zbench tune`` searches.
OPTION_KEYS: dict[str, tuple[str, ...]] = {
    "config": (),
    "bucket_size": ("reduce_bucket_size", "allgather_bucket_size"),
    "overlap_comm": ("overlap_comm",),
    "prefetch_size": ("stage3_prefetch_bucket_size",),
}
OPTIONS = tuple(OPTION_KEYS)
#: What ``zbench tune`` searches (estimated from the reference engine's traces: ``zbench.tune.deepspeed_estimate``),
#: each option's DeepSpeed default first:
#:
#: - the bucket at stages 1-2: the reference engine's flat groups of the same bytes; DeepSpeed's own 5e8 is tried too;
#: - ``overlap_comm`` at stages 1-2, where DeepSpeed leaves it off: off, each bucket's reduction runs on the compute
#:   stream as the bucket fills (``stage_1_and_2.py``, ``reduce_ipg_grads``), so nothing hides backward's
#:   communication; on, a side stream reduces it behind backward, with a second bucket buffer (``setup_buckets``).
#:   At stage 3 DeepSpeed turns it on itself, and it is not searched;
#: - ``prefetch_size`` at stage 3: the reference engine's prefetch of as many blocks as the elements fill (at least
#:   one); 0 gathers each module's parameters as it runs, so nothing hides them.
TUNABLES = (
    Tunable(
        "bucket_size", (BUCKET_ELEMENTS, 5_000_000, 500_000_000), stages=frozenset({1, 2}),
        trades="fewer, larger gradient reductions and parameter gathers against a larger bucket buffer and a "
        "larger last bucket nothing hides",
    ),
    Tunable(
        "overlap_comm", (False, True), stages=frozenset({1, 2}), serialized_at=(False,),
        serialized_phases=frozenset({"backward"}),
        trades="gradient reductions hidden behind backward (on a GPU) against a second bucket buffer",
    ),
    Tunable(
        "prefetch_size", (PREFETCH_ELEMENTS, 0, 500_000_000), stages=frozenset({3}), serialized_at=(0,),
        trades="parameter gathers hidden behind compute against parameters gathered ahead",
    ),
)  # fmt: skip


def checked_options(options: dict[str, Any]) -> None:
    """One line naming what is wrong with a DeepSpeed case's ``options``, as a ``ValueError``."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown or not isinstance(options.get("config", {}), dict):
        raise ValueError(
            f"deepspeed takes the options config (a DeepSpeed config as a mapping; or name the JSON file as the "
            f"suite's deepspeed_config), bucket_size and prefetch_size (elements) and overlap_comm (true/false), "
            f"got {dict(options)!r}"
        )
    for name, least in (("bucket_size", 1), ("prefetch_size", 0)):
        size = options.get(name, least)
        if isinstance(size, bool) or not isinstance(size, int) or size < least:
            raise ValueError(f"deepspeed option {name} must be a whole number of elements >= {least}, got {size!r}")
    if not isinstance(options.get("overlap_comm", False), bool):
        raise ValueError(f"deepspeed option overlap_comm must be true or false, got {options['overlap_comm']!r}")
    zero = dict(options.get("config") or {}).get("zero_optimization") or {}
    for name, keys in OPTION_KEYS.items():
        if name in options and (clash := [k for k in keys if k in zero and zero[k] != options[name]]):
            raise ValueError(
                f"deepspeed option {name} {options[name]} and the config's "
                f"{', '.join(f'{k} {zero[k]}' for k in clash)} disagree: set one"
            )


#: A JIT build of one of DeepSpeed's ops (its CPU shared-memory collectives, built at the first CPU run) takes about
#: a minute on two cores; a build lock older than this was left by a build that was killed.
STALE_BUILD_LOCK_S = 600.0


def deepspeed_config(spec: TrainSpec, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed config that trains as ``spec`` says (see the module docstring).

    A user's config (``options["config"]``, from a suite's ``deepspeed_config``) is the base: its
    settings are kept, those the harness maps (batch, accumulation, clipping, precision, stage, offload)
    were read from it and agree, and its optimizer and scheduler give way to the client optimizer. Its
    buckets are the ``bucket_size`` option's (``checked_options`` refuses one the config contradicts), else
    the config's, else ``BUCKET_ELEMENTS``; ``overlap_comm`` and ``prefetch_size`` likewise, else DeepSpeed's own.
    """
    user = {k: v for k, v in dict(spec.options.get("config") or {}).items() if k not in ("optimizer", "scheduler")}
    user.pop("train_batch_size", None)  # DeepSpeed derives it from the two below
    given = {key: spec.options[name] for name, keys in OPTION_KEYS.items() if name in spec.options for key in keys}
    zero: dict[str, Any] = {
        **dict.fromkeys(OPTION_KEYS["bucket_size"], BUCKET_ELEMENTS),
        **dict(user.get("zero_optimization") or {}),
        **given,
        "stage": spec.stage,
    }
    pinned = spec.device.type == "cuda"  # nothing to pin for on a CPU run
    sections = {"optimizer": ["offload_optimizer"], "optimizer+params": ["offload_optimizer", "offload_param"]}
    for section in sections.get(spec.offload, []):
        zero[section] = {"device": "cpu", **dict(zero.get(section) or {}), **({} if pinned else {"pin_memory": False})}
    config: dict[str, Any] = {
        **user,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "gradient_clipping": spec.grad_clip or 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if spec.precision == "bf16":  # reduced and accumulated in fp32, unless the user's config says otherwise
        config["bf16"] = {**dict(user.get("bf16") or {}), "enabled": True}
        config.setdefault("communication_data_type", "fp32")
        config.setdefault("data_types", {"grad_accum_dtype": "fp32"})
    else:  # the case's precision wins over a config written for bf16 (a bf16 case's fp32 probe trains from it)
        config.pop("bf16", None)
    return config


def extension_build_root() -> Path:
    """The folder this torch builds its JIT extensions in, found as ``torch.utils.cpp_extension`` finds it:
    ``$TORCH_EXTENSIONS_DIR`` as given, else one folder per Python and accelerator build under the default root.
    A CPU torch and a CUDA torch on one machine build apart, so a lock of one never blocks the other."""
    if given := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(given)
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def lock_files_block() -> bool:
    """Whether this torch's extension builds wait for a lock file to disappear (``FileBaton``, up to torch 2.13)."""
    import torch.utils.cpp_extension

    return hasattr(torch.utils.cpp_extension, "FileBaton")


def stale_build_locks(root: Path | None = None, now: float | None = None) -> dict[Path, float]:
    """DeepSpeed ops' JIT build locks in this torch's extension folder (``root``: ``extension_build_root()``) older
    than ``STALE_BUILD_LOCK_S``, with their ages in seconds.

    Note: torch's ``FileBaton`` waits for a lock file without end, and a build killed midway (a case's timeout, an
    interrupt) leaves its lock behind: every later DeepSpeed case on the machine would wait until its timeout.
    Newer torch (2.14) holds an OS advisory lock on the file instead, which the kernel releases when its holder
    dies, and leaves the file behind after every build: there a lock file is no sign of anything, and none is
    reported.
    """
    if not lock_files_block():
        return {}
    root = extension_build_root() if root is None else root
    now = time.time() if now is None else now
    found = {}
    finished = set(finished_build_locks(root))
    for lock in root.glob("deepspeed*/lock"):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # released meanwhile
            continue
        if age > STALE_BUILD_LOCK_S and lock not in finished:
            found[lock] = age
    return found


def finished_build_locks(root: Path | None = None) -> list[Path]:
    """Lock files of DeepSpeed op builds that finished: the module the build wrote is newer than its lock.

    Note: torch 2.14 leaves the lock file behind after every build (its lock is the kernel's, on the file), and
    Python and CUDA alone name the folder: torch 2.11 and 2.14 built for CUDA 13.0 share one. A torch that waits
    for the file to go (up to 2.13) would wait on such a leftover for ever; CI's first run on torch 2.11 after one
    on 2.14 failed its DeepSpeed cases on one (2026-11-28). A build under way has no module newer than its lock.
    """
    root = extension_build_root() if root is None else root
    finished = []
    for lock in root.glob("deepspeed*/lock"):
        try:
            locked_at = lock.stat().st_mtime
            if any(built.stat().st_mtime >= locked_at for built in lock.parent.glob("*.so")):
                finished.append(lock)
        except OSError:  # released meanwhile
            continue
    return finished


def clear_build_locks() -> None:
    """No build lock for DeepSpeed's ops to wait on for ever: a finished build's leftover is removed, and a killed
    build's (``stale_build_locks``) fails the case at once, naming the file."""
    if lock_files_block():
        for lock in finished_build_locks():
            lock.unlink(missing_ok=True)
    if stale := stale_build_locks():
        lock, age = next(iter(stale.items()))
        raise RuntimeError(
            f"{lock} is {age / 60:.0f} minutes old: a DeepSpeed op build was killed and left its lock, on which "
            "this case would wait forever; delete the file and run again"
        )


def _prepare_environment(spec: TrainSpec) -> None:
    """What DeepSpeed's launcher would have set, before ``deepspeed`` is first imported; and no build lock for its
    ops to wait on (``clear_build_locks``)."""
    clear_build_locks()
    local = spec.device.index if spec.device.type == "cuda" and spec.device.index is not None else dist.get_rank()
    os.environ.setdefault("LOCAL_RANK", str(local))
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if spec.device.type == "cuda" else "cpu")


def _tensors_held_by(obj: object, depth: int = 3) -> list[torch.Tensor]:
    """Every tensor in ``obj``'s attributes, in lists, tuples and dicts down to ``depth`` levels (not the base
    optimizer, counted as optimizer state)."""
    found: list[torch.Tensor] = []

    def walk(value: object, level: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif level < depth and isinstance(value, (list, tuple)):
            for item in value:
                walk(item, level + 1)
        elif level < depth and isinstance(value, dict):
            for item in value.values():
                walk(item, level + 1)

    for name, value in vars(obj).items():
        if name != "optimizer":
            walk(value, 0)
    return found


def _summed(*parts: dict[str, int]) -> dict[str, int]:
    return {loc: sum(part[loc] for part in parts) for loc in parts[0]}


class DeepSpeedEngine(EngineBase):
    def __init__(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> None:
        if group is not None and group is not dist.group.WORLD:
            raise ValueError("the DeepSpeed adapter runs on the default process group only")
        checked_options(dict(spec.options))
        _prepare_environment(spec)
        import deepspeed

        self.spec = spec
        self._model, self._deepspeed = model, deepspeed
        self.engine: Any = None

    def _build(self, rows: int) -> None:
        """DeepSpeed's config names the micro-batch size, known from the first batch."""
        optimizer = self.spec.make_optimizer(self._model.parameters())
        self.engine, self.optimizer, _, _ = self._deepspeed.initialize(
            model=self._model,
            optimizer=optimizer,
            config=deepspeed_config(self.spec, rows),
            dist_init_required=False,
        )

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        if self.engine is None:
            self._build(micro_batches[0][0].shape[0])
        total = torch.zeros((), device=micro_batches[0][0].device)
        for batch in micro_batches:
            loss = self.engine(*batch)
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            self.engine.step()  # steps the optimizer at the accumulation boundary only
            total += loss.detach().float()
        return total / len(micro_batches)

    def metrics(self) -> dict[str, float]:
        norm = None if self.engine is None else self.engine.get_global_grad_norm()
        return {} if norm is None else {"grad_norm": float(norm)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The fp32 master values (gathered), which every rank steps; bf16 copies would add their rounding."""
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.engine.module if self.engine is not None else self._model
        out = {}
        for name, p in module.named_parameters():
            full = safe_get_full_fp32_param(p) if self.engine is not None else p
            out[name] = full.detach().float().cpu().clone()
        return out

    def state_bytes(self) -> dict[str, dict[str, int]]:
        """DeepSpeed's own partitions, each storage once (the categories of deepspeed_layout.py):

        - parameters: the compute parameters (stage 3: each one's ``ds_tensor`` shard, and the whole tensor of
          those it keeps persistent) and, with offload, the host staging copy of the partition;
        - master weights: the fp32 partitions; optimizer state: the base optimizer's;
        - gradients: every other tensor its ZeRO optimizer holds between steps (gradient partitions, flat
          gradient buffers, offload buffers) and the masters' gradients.
        """
        out = empty_state_bytes()
        if self.engine is None:
            return out
        zero = self.optimizer
        params = list(self.engine.module.parameters())
        shards = [p.ds_tensor for p in params] if self.spec.stage == 3 else params
        persistent = [p.data for p in params if getattr(p, "ds_persist", False)] if self.spec.stage == 3 else []
        staging = list(getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", []))
        masters = [t for name in MASTER_ATTRIBUTES for t in getattr(zero, name, [])]
        state = optimizer_tensors(zero.optimizer)
        counted = {storage_key(t) for t in (*shards, *persistent, *staging, *masters, *state)}
        others = [t for t in _tensors_held_by(zero) if storage_key(t) not in counted]
        offloaded = self.spec.offload != "none"
        out["parameters"] = _summed(
            self._bytes(shards, host=self.spec.offload == "optimizer+params"),
            self._bytes(persistent, host=False),
            self._bytes(staging, host=True),
        )
        out["master_weights"] = self._bytes(masters, host=offloaded)
        out["optimizer_state"] = self._bytes(state, host=offloaded)
        out["gradients"] = self._bytes([*others, *(m.grad for m in masters)], host=offloaded)
        return out

    def buffer_bytes(self) -> dict[str, int]:
        """DeepSpeed's gradient bucket buffers (``ipg_buckets``), which it keeps between steps and its model states
        leave out: stage 3's, allocated whole when it builds, and stages 1-2's, allocated at the first backward
        (two with ``overlap_comm``). What ``zbench tune`` adds for them to an estimate
        (``zbench.tune.deepspeed_estimate.bucket_buffer_bytes``) is checked against these."""
        if self.engine is None:
            return {}
        buffers: list[torch.Tensor] = []
        for bucket in getattr(self.optimizer, "ipg_buckets", {}).values():
            held = bucket.buffer
            buffers.extend(held if isinstance(held, list) else [] if held is None else [held])
        return {loc: n for loc, n in tensor_bytes(buffers, compute_device=self.spec.device).items() if n}

    def _bytes(self, tensors: list[torch.Tensor], *, host: bool) -> dict[str, int]:
        """Bytes by location; on a CPU-only run a host tier is on the compute device too, so ``host`` says where
        it is meant to be."""
        held = tensor_bytes(tensors, compute_device=self.spec.device)
        return moved_to_host({"held": held})["held"] if host and self.spec.device.type == "cpu" else held

    def close(self) -> None:
        self.engine = None


class DeepSpeed(ImplementationBase):
    name = "deepspeed"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            stages=frozenset({1, 2, 3}),
            precisions=frozenset({"fp32", "bf16"}),
            offload=frozenset({"none", "optimizer", "optimizer+params"}),
            keeps_master_weights=True,
            tunables=TUNABLES,
            options=frozenset(OPTIONS),
            state_allowance=0.02,  # against its own layout (state_layout), not the ZeRO formulas
            untraceable="DeepSpeed moves and partitions the model itself (module._apply, its own accelerator and "
            "communication setup), which fake tensors in a fake process group do not support yet",
            missing=None if importlib.util.find_spec("deepspeed") else INSTALL_HINT,
        )

    def build(self, model: nn.Module, spec: TrainSpec, group: ProcessGroup | None) -> DeepSpeedEngine:
        return DeepSpeedEngine(model, spec, group)

    def expected_comm_elements(self, shape: ModelShape, world: int, stage: int) -> int:
        """Its own pattern (one micro-batch; docs/methods.md#deepspeed), not the ZeRO formula's: at stages 1-2 it
        all-reduces the gradients (2Ψ, where a reduce-scatter is Ψ) and all-gathers the updated partition (Ψ); at
        stage 3 it gathers every parameter for forward (Ψ), again for backward only those it does not keep whole
        (Ψ - persistent, at DeepSpeed's default threshold), and reduce-scatters the gradients (Ψ)."""
        sizes = shape.parameter_sizes
        if stage < 3:
            return 3 * sum(sizes)
        return 3 * sum(sizes) - persistent_elements(sizes, world, {})

    def state_layout(self, spec: TrainSpec, sizes: tuple[int, ...], world: int) -> dict[str, dict[str, float]]:
        """DeepSpeed's own layout (deepspeed_layout.py), for the config the case runs."""
        return deepspeed_layout(
            sizes=sizes,
            world=world,
            stage=spec.stage,
            precision=spec.precision,
            offload=spec.offload,
            optimizer_bytes=optimizer_bytes_per_param(spec.optimizer, spec.momentum),
            grad_accum=spec.grad_accum,
            config=deepspeed_config(spec, micro_batch=1),  # the batch size moves no state
        )


IMPLEMENTATION = DeepSpeed()
