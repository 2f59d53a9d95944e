"""A DeepSpeed JSON config as a suite's settings: what maps onto every implementation, and what does not.

A suite that names ``deepspeed_config: ds.json`` trains what that file describes, for DeepSpeed
(which gets the whole file) and for every other implementation where a setting corresponds:

- ``zero_optimization.stage`` is the stage of every implementation that has it;
- ``zero_optimization.offload_optimizer`` / ``offload_param`` (``cpu``, ``nvme``) are the offload
  mode (``optimizer``, ``optimizer+params``, ``nvme``); an implementation without that mode runs
  without offload, and the case lists the offload keys as not applied;
- ``bf16.enabled`` / ``fp16.enabled`` are the precision; ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``, ``gradient_clipping`` and the ``optimizer`` (``Adam``/``AdamW``
  with ``lr``, ``weight_decay``, ``betas``, ``eps``; ``SGD``) are the suite's own keys.

Everything else (bucket sizes, overlap, prefetch, persistence thresholds, a scheduler, ...)
is DeepSpeed's alone: each case of another implementation lists those keys, so nothing is
dropped silently. The DeepSpeed case applies them all but the optimizer section, which it
replaces with the same optimizer built by the harness, and a scheduler (not applied). A key
DeepSpeed does not know, or a value of the wrong kind, is bad input.

Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: DeepSpeed's top-level config keys (docs: deepspeed.ai/docs/config-json).
TOP_LEVEL = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "amp", "torch_autocast", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "communication_data_type", "seq_parallel_communication_data_type", "data_types", "steps_per_print",
    "wall_clock_breakdown", "dump_state", "memory_breakdown", "activation_checkpointing", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "aio", "checkpoint", "elasticity", "autotuning",
    "compression_training", "data_efficiency", "curriculum_learning", "pipeline", "sparse_attention",
    "disable_allgather", "dataloader_drop_last", "gradient_accumulation_dtype", "load_universal_checkpoint",
    "use_node_local_storage", "nebula", "weight_quantization", "hybrid_engine", "eigenvalue", "progressive_layer_drop",
    "quantize_training", "mics_shard_size", "mics_hierarchical_params_gather", "zero_quantized_weights",
})  # fmt: skip
#: Keys of ``zero_optimization``.
ZERO_KEYS = frozenset({
    "stage", "offload_optimizer", "offload_param", "contiguous_gradients", "overlap_comm", "reduce_scatter",
    "reduce_bucket_size", "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "sub_group_size",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold", "load_from_fp32_weights",
    "elastic_checkpoint", "ignore_unused_parameters", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
    "use_multi_rank_bucket_allreduce", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "legacy_stage1", "use_all_reduce_for_fetch_params", "module_granularity_threshold",
})  # fmt: skip
OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}
#: Keys whose meaning every implementation gets (see the module docstring); the rest are DeepSpeed's alone.
MAPPED = frozenset({
    "train_batch_size",  # micro-batch x accumulation x world size: derived, as DeepSpeed derives it
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "bf16", "fp16",
    "optimizer", "zero_optimization.stage", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
})  # fmt: skip
#: Keys that change nothing a benchmark measures (logging, printing).
COSMETIC = frozenset({"steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state"})


class DeepSpeedConfigError(ValueError):
    """The config file cannot be read or says something zbench cannot map; one line for the user."""


@dataclass(frozen=True)
class Mapped:
    """What a DeepSpeed config means for a suite."""

    settings: dict[str, Any]
    """The file's content, as DeepSpeed gets it."""
    suite: dict[str, Any]
    """Suite keys it sets: stage, precisions, offload, micro_batch, grad_accum, grad_clip, optimizer."""
    deepspeed_only: list[str] = field(default_factory=list)
    """Dotted keys only DeepSpeed applies (listed on every other implementation's cases)."""
    not_applied_by_deepspeed: list[str] = field(default_factory=list)
    """Dotted keys the DeepSpeed case does not apply either (its scheduler)."""


def _suggest(key: str, known: frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _offload(zero: dict[str, Any], stage: int) -> str:
    for legacy in ("cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory"):
        if legacy in zero:
            raise DeepSpeedConfigError(
                f"zero_optimization.{legacy} is DeepSpeed's old spelling: use offload_optimizer / offload_param"
            )

    def device(section: str) -> str:
        value = zero.get(section) or {}
        if not isinstance(value, dict):
            raise DeepSpeedConfigError(f"zero_optimization.{section} must be a mapping, got {value!r}")
        return str(value.get("device", "none")).lower()

    optimizer, params = device("offload_optimizer"), device("offload_param")
    if params != "none" and stage != 3:
        raise DeepSpeedConfigError(f"zero_optimization.offload_param needs stage 3 (the config says {stage})")
    if params != "none" and optimizer == "none":
        raise DeepSpeedConfigError(
            "offload_param without offload_optimizer: zbench offloads parameters only with the optimizer "
            "(its optimizer+params mode)"
        )
    if "nvme" in (optimizer, params):
        return "nvme"
    if params == "cpu":
        return "optimizer+params"
    if optimizer == "cpu":
        return "optimizer"
    if {optimizer, params} <= {"none"}:
        return "none"
    raise DeepSpeedConfigError(f"zero_optimization offload device {optimizer!r}/{params!r}: allowed cpu, nvme, none")


#: Keys where ``"auto"`` means "from the suite" (the batch sizes the harness sets anyway).
_AUTO_ALLOWED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
)


def _no_auto(settings: dict[str, Any]) -> None:
    """``"auto"`` is a placeholder Hugging Face's Trainer fills in; zbench cannot guess it but for the batch keys."""

    def walk(value: Any, where: str) -> None:
        if value == "auto" and where not in _AUTO_ALLOWED:
            raise DeepSpeedConfigError(f"{where}: 'auto' is a Hugging Face placeholder; write the value")
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}" if where else str(key))

    walk(settings, "")


def _number(value: Any, key: str) -> float | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeepSpeedConfigError(f"{key} must be a number or 'auto', got {value!r}")
    return float(value)


def map_config(settings: Any) -> Mapped:
    """The suite settings and the DeepSpeed-only keys of a parsed config (see the module docstring)."""
    if not isinstance(settings, dict):
        raise DeepSpeedConfigError(f"a DeepSpeed config is a JSON object, got {type(settings).__name__}")
    for key in settings:
        if key not in TOP_LEVEL:
            raise DeepSpeedConfigError(f"unknown DeepSpeed config key {key!r}{_suggest(key, TOP_LEVEL)}")
    zero = settings.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise DeepSpeedConfigError(f"zero_optimization must be a mapping, got {zero!r}")
    for key in zero:
        if key not in ZERO_KEYS:
            raise DeepSpeedConfigError(f"unknown key zero_optimization.{key!r}{_suggest(key, ZERO_KEYS)}")
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise DeepSpeedConfigError(
            f"zero_optimization.stage must be 1, 2 or 3, got {stage!r} (stage 0 is plain data parallelism: DDP, "
            "the reference every suite runs)"
        )
    _no_auto(settings)
    for section in ("bf16", "fp16"):
        if section in settings and not isinstance(settings[section], dict):
            raise DeepSpeedConfigError(
                f'{section} must be a mapping such as {{"enabled": true}}, got {settings[section]!r}'
            )
    enabled = {p for p in ("bf16", "fp16") if p in settings and settings[p].get("enabled")}
    if len(enabled) > 1:
        raise DeepSpeedConfigError("bf16 and fp16 are both enabled")
    suite: dict[str, Any] = {"stage": stage, "precisions": [enabled.pop() if enabled else "fp32"]}
    suite["offload"] = [_offload(zero, stage)]
    for key, name in (("train_micro_batch_size_per_gpu", "micro_batch"), ("gradient_accumulation_steps", "grad_accum")):
        value = _number(settings.get(key), key)
        if value is not None:
            if value < 1 or value != int(value):
                raise DeepSpeedConfigError(f"{key} must be a positive integer, got {settings[key]!r}")
            suite[name] = int(value)
    if "gradient_clipping" in settings:  # 0 says "no clipping" just as firmly as a bound says clip
        suite["grad_clip"] = _number(settings["gradient_clipping"], "gradient_clipping") or None
    if "optimizer" in settings:
        suite["optimizer"] = _optimizer(settings["optimizer"])
    dotted = [f"zero_optimization.{k}" for k in zero] + [k for k in settings if k != "zero_optimization"]
    only = sorted(k for k in dotted if k not in MAPPED and k not in COSMETIC)
    unapplied = [k for k in only if k == "scheduler"] + _optimizer_extras(settings.get("optimizer"))
    return Mapped(
        settings=settings, suite=suite, deepspeed_only=sorted({*only, *unapplied}), not_applied_by_deepspeed=unapplied
    )


#: Optimizer parameters every implementation uses anyway (TrainSpec's defaults) or that change nothing here.
_OPTIMIZER_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": None, "adam_w_mode": True}


def _optimizer_extras(section: Any) -> list[str]:
    """``optimizer.params`` keys no implementation applies (the harness builds one optimizer for all of them)."""
    params = (section or {}).get("params") or {}
    extras = []
    for key, value in params.items():
        if key in ("lr", "weight_decay", "momentum"):
            continue
        if key in _OPTIMIZER_DEFAULTS:
            default = _OPTIMIZER_DEFAULTS[key]
            if default is None or (list(value) if isinstance(value, (list, tuple)) else value) == default:
                continue
        extras.append(f"optimizer.params.{key}")
    return extras


def _optimizer(section: Any) -> dict[str, Any]:
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise DeepSpeedConfigError(f"optimizer must be a mapping with a 'type', got {section!r}")
    name = OPTIMIZERS.get(section["type"].lower())
    if name is None:
        raise DeepSpeedConfigError(f"optimizer type {section['type']!r}: zbench runs {', '.join(sorted(OPTIMIZERS))}")
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise DeepSpeedConfigError(f"optimizer.params must be a mapping, got {params!r}")
    out: dict[str, Any] = {"name": name}
    for key in ("lr", "weight_decay", "momentum"):
        value = _number(params.get(key), f"optimizer.params.{key}")
        if value is not None:
            out[key] = value
    return out


def read(path: Path) -> Mapped:
    """Read and map a DeepSpeed JSON config file; every problem is one ``DeepSpeedConfigError`` naming the file."""
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise DeepSpeedConfigError(f"{path}: DeepSpeed config not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DeepSpeedConfigError(f"{path}: not a readable JSON file: {exc}") from None
    try:
        return map_config(settings)
    except DeepSpeedConfigError as exc:
        raise DeepSpeedConfigError(f"{path}: {exc}") from None
