"""Use zbench from your own test suite: assert that an implementation trains exactly like DDP.

    from zbench.testing import assert_equivalent_to_ddp

    def test_my_engine_matches_ddp():
        assert_equivalent_to_ddp("my_pkg.engine:MyZero", model="tiny", world_size=2)

Runs on CPU (gloo) by default, in real process groups, exactly as ``zbench run``
does; raises ``AssertionError`` with the figures when the implementation fails,
is skipped or diverges.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from zbench.errors import UsageError
from zbench.results.record import CaseRecord
from zbench.run.console import Progress
from zbench.run.runner import run_suite
from zbench.suite import config as suite_mod
from zbench.suite import preflight
from zbench.values import Offload, OptimizerName, Precision

#: Which arguments of ``assert_equivalent_to_ddp`` a DeepSpeed config's suite keys stand for.
_ARGUMENTS = {
    "precisions": ("precision",),
    "offload": ("offload",),
    "micro_batch": ("micro_batch",),
    "grad_accum": ("grad_accum",),
    "grad_clip": ("grad_clip",),
    "optimizer": ("optimizer", "lr", "weight_decay", "momentum"),
}


def _left_to_deepspeed(settings: dict[str, Any], path: Path, *, given: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without those the DeepSpeed config at ``path`` sets; an argument it sets that was also given
    (a value other than the default) or a ``stage`` is a conflict, as in a suite file."""
    import inspect

    from zbench.suite.deepspeed_config import DeepSpeedConfigError, read

    try:
        mapped = read(path)
    except DeepSpeedConfigError as exc:
        raise UsageError(f"deepspeed_config: {exc}") from None
    defaults = {n: p.default for n, p in inspect.signature(assert_equivalent_to_ddp).parameters.items()}
    names = [a for key in mapped.suite if key in _ARGUMENTS for a in _ARGUMENTS[key]]
    both = [a for a in ["stage", *names] if given[a] != defaults[a]]
    if both:
        raise UsageError(f"{', '.join(both)} set by both the call and {path.name}; keep one")
    return {k: v for k, v in settings.items() if k not in mapped.suite}


def assert_equivalent_to_ddp(
    implementation: str,
    *,
    model: str = "tiny",
    world_size: int = 2,
    steps: int = 10,
    precision: Precision = "fp32",
    device: str = "cpu",
    micro_batch: int = 4,
    grad_accum: int = 1,
    grad_clip: float | None = None,
    optimizer: OptimizerName = "adamw",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    stage: int | None = None,
    offload: Offload = "none",
    seed: int = 0,
    options: dict[str, Any] | None = None,
    timeout_s: float = 300,
    results: str | Path | None = None,
    deepspeed_config: str | Path | None = None,
    **suite_keys: Any,
) -> CaseRecord:
    """Train ``implementation`` and DDP on the same model, data and seed; fail unless they agree.

    Every training setting a suite file has can be given: the named ones above, and any other suite key
    (``seq_len``, ``noise_twin``, ...) through ``suite_keys``, validated like a suite file. Returns the
    implementation's case record (step times, memory, every equivalence check's figure and bound).
    ``results`` keeps the result files; by default they go to a temporary directory.

    ``deepspeed_config`` names a DeepSpeed JSON config to train, as a suite's ``deepspeed_config`` does: it sets
    the stage and what else it says (precision, offload, batch, accumulation, clipping, optimizer), which then
    may not be given here too.
    """
    entry: dict[str, Any] = {"name": implementation, "options": options or {}}
    if stage is not None:
        entry["stages"] = [stage]
    settings: dict[str, Any] = {
        "precisions": [precision],
        "offload": [offload],
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "grad_clip": grad_clip,
        "optimizer": {"name": optimizer, "lr": lr, "weight_decay": weight_decay, "momentum": momentum},
    }
    if deepspeed_config is not None:
        given: dict[str, Any] = dict(stage=stage, precision=precision, offload=offload, micro_batch=micro_batch)
        given |= dict(grad_accum=grad_accum, grad_clip=grad_clip, optimizer=optimizer, lr=lr)
        given |= dict(weight_decay=weight_decay, momentum=momentum)
        settings = _left_to_deepspeed(settings, Path(deepspeed_config), given=given)
        suite_keys["deepspeed_config"] = str(Path(deepspeed_config).resolve())
    config = suite_mod.from_dict(
        {
            "name": "zbench.testing",
            "device": device,
            "models": [model],
            "world_sizes": [world_size],
            "implementations": ["ddp", entry],
            **settings,
            "steps": steps,
            "warmup_steps": min(3, steps - 1),
            "seed": seed,
            "timeout_s": timeout_s,
            **suite_keys,
        },
        source="assert_equivalent_to_ddp",
    )
    suite = preflight.prepare(suite_mod.from_flags(config))
    with tempfile.TemporaryDirectory(prefix="zbench-testing-") as tmp:
        result = run_suite(suite, results_root=Path(results or tmp), progress=Progress(quiet=True))
    asked = suite.config.precisions[0]  # the argument's, or the DeepSpeed config's (a bf16 run adds fp32 references)
    record = next(
        r
        for r in result.records
        if r.config.implementation == implementation and r.config.precision == asked and not r.config.noise_twin
    )
    if not record.ok:
        reason = record.skip_reason or record.error
        raise AssertionError(f"{implementation} did not run ({record.status}): {reason}\n{record.stderr_tail}")
    eq = record.equivalence
    if eq is None or not eq.equivalent:
        checks = "; ".join(
            f"{c.label}: {'not run' if c.passed is None else 'PASS' if c.passed else 'FAIL'}"
            + (f" {c.figure:.3g} (bound {c.bound:.3g})" if c.figure is not None and c.bound is not None else "")
            + (f" [{c.detail}]" if c.detail else "")
            for c in (eq.checks if eq else [])
        )
        raise AssertionError(
            f"{implementation} is not equivalent to DDP: {eq.reason if eq else 'not checked'}"
            + (f"\nchecks: {checks}" if checks else "")
        )
    return record
