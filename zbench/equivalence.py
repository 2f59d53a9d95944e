"""Does a case train exactly like DDP? Per-step loss and final parameters against the reference case.

Relative loss difference per step is ``|loss - ref| / |ref|``; the relative
parameter difference is the model-wide ``||p - ref||_2 / ||ref||_2`` over every
parameter. Both must stay within the precision's tolerance. The worst single
tensor (its own ``||p - ref|| / ||ref||``) is stored too, to point at a culprit.

Note: the verdict does not use an element-wise or per-tensor bound, because
Adam amplifies rounding in parameters whose true gradient is zero. The
attention key bias is one (softmax ignores a constant added to every score):
its "gradient" is pure rounding noise, which Adam normalises into updates of
size ``lr``. Any two correct implementations that sum gradients in a different
order (a reduce-scatter instead of DDP's all-reduce, world 4) disagree there by
~1e-4 of the tensor after a few steps, while the whole model agrees to ~3e-7.
A real bug (a gradient not averaged, a missed shard) moves the loss and the
model-wide difference by orders of magnitude more.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from zbench.record import Equivalence
from zbench.values import Precision

#: Relative tolerance per precision (docs/methods.md#equivalence). fp32 is 1e-5; the low
#: precisions differ from DDP's autocast by their rounding alone, and are stated
#: in every report.
TOLERANCE: dict[Precision, float] = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}


def loss_differences(losses: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """Max absolute and max relative per-step loss difference."""
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses against {len(reference)} reference losses")
    abs_diff = [abs(a - b) for a, b in zip(losses, reference)]
    rel_diff = [d / max(abs(b), 1e-12) for d, b in zip(abs_diff, reference)]
    return max(abs_diff, default=0.0), max(rel_diff, default=0.0)


def parameter_differences(
    params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> tuple[float, float, str | None, float]:
    """Max absolute difference, model-wide relative L2 difference, the worst tensor and its relative L2 difference."""
    if params.keys() != reference.keys():
        missing = sorted(reference.keys() - params.keys())[:3]
        extra = sorted(params.keys() - reference.keys())[:3]
        raise ValueError(f"parameter names differ from the reference (missing {missing}, unexpected {extra})")
    worst_abs, worst_rel, worst_name = 0.0, 0.0, None
    diff_sq, ref_sq = 0.0, 0.0
    for name, ref in reference.items():
        p = params[name]
        if p.shape != ref.shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, reference {tuple(ref.shape)}")
        delta = p.double() - ref.double()
        d2, r2 = float((delta * delta).sum()), float((ref.double() ** 2).sum())
        diff_sq, ref_sq = diff_sq + d2, ref_sq + r2
        worst_abs = max(worst_abs, delta.abs().max().item())
        rel = (d2 / max(r2, 1e-24)) ** 0.5
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
    return worst_abs, (diff_sq / max(ref_sq, 1e-24)) ** 0.5, worst_name, worst_rel


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def verdict(
    *,
    losses: Sequence[float],
    reference_losses: Sequence[float],
    params_path: Path | None,
    reference_params_path: Path | None,
    precision: Precision,
    reference_case: str,
) -> Equivalence:
    """The stored equivalence verdict: differences, tolerance, pass or fail, and why."""
    tolerance = TOLERANCE[precision]
    out = Equivalence(equivalent=False, reference_case=reference_case, tolerance_rel=tolerance)
    try:
        out.max_abs_loss_diff, out.max_rel_loss_diff = loss_differences(losses, reference_losses)
        if params_path is None or reference_params_path is None:
            raise ValueError("final parameters were not stored")
        (out.max_abs_param_diff, out.max_rel_param_diff, out.worst_parameter, out.worst_parameter_rel_diff) = (
            parameter_differences(load_params(params_path), load_params(reference_params_path))
        )
    except (ValueError, OSError, RuntimeError) as exc:
        out.reason = str(exc)
        return out
    failures = [
        what
        for what, value in (("loss", out.max_rel_loss_diff), ("parameters", out.max_rel_param_diff))
        if not value <= tolerance
    ]
    out.equivalent = not failures
    if failures:
        out.reason = " and ".join(failures) + f" differ from {reference_case} beyond {tolerance:g} relative"
    return out


def not_checked(why: str) -> Equivalence:
    """A case that could not be compared counts as not equivalent, with the reason."""
    return Equivalence(equivalent=False, reason=f"not checked: {why}")
