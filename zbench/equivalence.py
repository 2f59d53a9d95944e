"""Does a case train exactly like DDP? Per-step loss and final parameters against the reference case.

Relative loss difference per step is ``|loss - ref| / |ref|``; relative
parameter difference per tensor is ``max|p - ref| / max|ref|`` (the error
against the tensor's own scale, so a bias that is near zero is not blown up).
Both must stay within the precision's tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

#: Relative tolerance per precision. fp32 is the design's 1e-5; the low
#: precisions differ from DDP's autocast by their rounding alone, and are stated
#: in every report.
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}


def loss_differences(losses: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """Max absolute and max relative per-step loss difference."""
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses against {len(reference)} reference losses")
    abs_diff = [abs(a - b) for a, b in zip(losses, reference)]
    rel_diff = [d / max(abs(b), 1e-12) for d, b in zip(abs_diff, reference)]
    return max(abs_diff, default=0.0), max(rel_diff, default=0.0)


def parameter_differences(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float, str | None]:
    """Max absolute and max relative difference over tensors, and the name of the worst tensor."""
    if params.keys() != reference.keys():
        missing = sorted(reference.keys() - params.keys())[:3]
        extra = sorted(params.keys() - reference.keys())[:3]
        raise ValueError(f"parameter names differ from the reference (missing {missing}, unexpected {extra})")
    worst_abs, worst_rel, worst_name = 0.0, 0.0, None
    for name, ref in reference.items():
        p = params[name]
        if p.shape != ref.shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, reference {tuple(ref.shape)}")
        diff = (p.double() - ref.double()).abs().max().item()
        rel = diff / max(ref.double().abs().max().item(), 1e-12)
        worst_abs = max(worst_abs, diff)
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
    return worst_abs, worst_rel, worst_name


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def verdict(*, losses: Sequence[float], reference_losses: Sequence[float], params_path: Path | None,
            reference_params_path: Path | None, precision: str, reference_case: str) -> dict:
    """The stored equivalence record: differences, tolerance, pass or fail, and why."""
    tolerance = TOLERANCE[precision]
    out: dict = {"reference_case": reference_case, "tolerance_rel": tolerance}
    try:
        out["max_abs_loss_diff"], out["max_rel_loss_diff"] = loss_differences(losses, reference_losses)
        if params_path is None or reference_params_path is None:
            raise ValueError("final parameters were not stored")
        abs_p, rel_p, worst = parameter_differences(load_params(params_path), load_params(reference_params_path))
        out.update(max_abs_param_diff=abs_p, max_rel_param_diff=rel_p, worst_parameter=worst)
    except (ValueError, OSError, RuntimeError) as exc:
        return {**out, "equivalent": False, "reason": str(exc)}
    failures = [what for what, value in (("loss", out["max_rel_loss_diff"]), ("parameters", out["max_rel_param_diff"]))
                if not value <= tolerance]
    out["equivalent"] = not failures
    if failures:
        out["reason"] = " and ".join(failures) + f" differ from {reference_case} beyond {tolerance:g} relative"
    return out
