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

from zbench import preflight
from zbench import suite as suite_mod
from zbench.console import Progress
from zbench.record import CaseRecord
from zbench.runner import run_suite
from zbench.values import Precision


def assert_equivalent_to_ddp(
    implementation: str,
    *,
    model: str = "tiny",
    world_size: int = 2,
    steps: int = 10,
    precision: Precision = "fp32",
    device: str = "cpu",
    grad_accum: int = 1,
    grad_clip: float | None = None,
    options: dict[str, Any] | None = None,
    timeout_s: float = 300,
    results: str | Path | None = None,
) -> CaseRecord:
    """Train ``implementation`` and DDP on the same model, data and seed; fail unless they agree.

    Returns the implementation's case record (step times, memory, the equivalence figures).
    ``results`` keeps the result files; by default they go to a temporary directory.
    """
    config = suite_mod.from_dict(
        {
            "name": "zbench.testing",
            "device": device,
            "models": [model],
            "world_sizes": [world_size],
            "implementations": ["ddp", {"name": implementation, "options": options or {}}],
            "precisions": [precision],
            "steps": steps,
            "warmup_steps": min(3, steps - 1),
            "grad_accum": grad_accum,
            "grad_clip": grad_clip,
            "timeout_s": timeout_s,
        },
        source="assert_equivalent_to_ddp",
    )
    suite = preflight.prepare(suite_mod.from_flags(config))
    with tempfile.TemporaryDirectory(prefix="zbench-testing-") as tmp:
        result = run_suite(suite, results_root=Path(results or tmp), progress=Progress(quiet=True))
    record = next(r for r in result.records if r.config.implementation == implementation)
    if not record.ok:
        reason = record.skip_reason or record.error
        raise AssertionError(f"{implementation} did not run ({record.status}): {reason}\n{record.stderr_tail}")
    eq = record.equivalence
    if eq is None or not eq.equivalent:
        raise AssertionError(
            f"{implementation} is not equivalent to DDP: {eq.reason if eq else 'not checked'} "
            f"(max rel loss diff {eq.max_rel_loss_diff if eq else None}, param rel L2 diff "
            f"{eq.max_rel_param_diff if eq else None} in {eq.worst_parameter if eq else None}, "
            f"tolerance {eq.tolerance_rel if eq else None})"
        )
    return record
