"""Does a case train exactly like DDP? Five checks against the DDP reference, bounded by the measured noise.

Checks (``docs/methods.md#equivalence`` has the measurements behind each choice):

- ``loss``: the largest relative per-step loss difference.
- ``grad_norm``: the largest relative per-step difference of the global gradient norm, which every
  engine reports (``Engine.metrics()["grad_norm"]``). AdamW normalises a constant gradient scale away,
  so a gradient summed instead of averaged, or divided twice, leaves loss and parameters alone;
  the norm shows it at once (a factor of the world size, or of the accumulation count).
- ``parameters``: per tensor, ``||p - ref|| / ||ref||`` of the final parameters; the worst tensor
  relative to its own bound is reported. Per tensor, so that a bug confined to one small tensor
  (a LayerNorm bias) is not diluted by the embeddings.
- ``ranks``: every rank's final parameters hash the same (a rank that drifts from the others is
  invisible in rank 0's parameters).
- ``model_state``: the bytes held per category (parameters, gradients, optimizer state, master
  weights) match what the declared stage, precision and offload imply, within the implementation's
  declared allowance: a bf16 master copy where fp32 is required halves ``master_weights``.

Bounds. Correct implementations differ from DDP by rounding, amplified by training: it grows with
the run (AdamW turns the pure-rounding "gradient" of the attention key bias into full-size steps)
and is orders of magnitude larger in bf16. So the bounds are not fixed: the run measures the noise
of its own group with a *noise twin* (``Case.noise_twin``: DDP again, with each rank's batch split
into another number of micro-batches: the same training summed in another order), and each bound is
``multiple x`` the twin's own difference from the reference, never below a least bound. Without a
twin (a batch that cannot be split evenly) the checks fall back to the least bounds and say so.

bf16 (and fp16). Rounding noise there is orders of magnitude larger, so a logic bug that fp32 catches a hundred
times over (a 0.1% learning-rate error, weight decay skipped on biases, a stale gradient on one tensor) can sit
inside the bf16 bounds. A bf16 case therefore also trains in fp32 after its run (``zbench.rank.probe``), and that
*fp32 probe* is judged like an fp32 case (loss, gradient norm, parameters, ranks: ``probe_checks``) against the
fp32 group's reference and twin. The case is equivalent only when both its own run and its probe are; each check
says which run it judged (``Check.probe``). Bugs that live only in the bf16 path are the bf16 run's checks' (and
the model-state check's) to catch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from zbench.results.record import CaseRecord, Check, Equivalence, Fp32Probe
from zbench.values import Precision


@dataclass(frozen=True)
class Bound:
    """A check's bound: ``multiple`` x the noise twin's figure, at least ``least`` (per precision)."""

    multiple: dict[Precision, float]
    least: dict[Precision, float]

    def of(self, precision: Precision, noise: float | None) -> float:
        floor = self.least[precision]
        return floor if noise is None else max(self.multiple[precision] * noise, floor)


#: Measured on tiny/small/medium at world 1-4, 20-400 steps (docs/methods.md#equivalence): correct
#: implementations reach at most ~2x the twin's figure in fp32 (loss, parameters) and ~20x in bf16
#: (parameters: ZeRO's bf16 compute copy against DDP's autocast). A gradient norm differs by the
#: arithmetic of the norm itself (a 2-norm over millions of fp32 values, accumulated sequentially on
#: CPU, is off by up to ~2e-4; ZeRO takes it over flat shards, DDP per tensor), while a scale bug moves
#: it by tens of percent or more: its least bound is 1e-3 (fp32) and 1e-2 (bf16, fp16). In bf16 a tensor
#: that started at zero (a LayerNorm bias) differs between a bf16-compute-copy design (ZeRO, FSDP) and DDP's
#: autocast by up to ~8% of its norm after 20 steps, which no twin of DDP shows: per tensor, only 25% counts
#: there; finer bf16 bugs are left to the loss, gradient-norm, rank and model-state checks and to the fp32 run.
#: The same structural difference reaches ~2.4e-3 (~10x the twin) in the per-step loss on a tied-embedding model
#: (the shared weight is rounded for both its uses), hence 20x the twin and at least 4e-3 for the bf16 loss.
BOUNDS: dict[str, Bound] = {
    "loss": Bound(multiple={"fp32": 10, "bf16": 20, "fp16": 20}, least={"fp32": 1e-6, "bf16": 4e-3, "fp16": 4e-3}),
    "grad_norm": Bound(multiple={"fp32": 10, "bf16": 10, "fp16": 10}, least={"fp32": 1e-3, "bf16": 1e-2, "fp16": 1e-2}),
    "parameters": Bound(
        multiple={"fp32": 10, "bf16": 50, "fp16": 50}, least={"fp32": 1e-6, "bf16": 0.25, "fp16": 0.25}
    ),
}
#: Without a noise twin the parameter check falls back to the model-wide relative L2 difference (per tensor
#: it would trip on the zero-gradient key bias) against these bounds.
MODEL_WIDE_BOUND: dict[Precision, float] = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}
#: Model-state bytes may differ from the formulas by padding and uneven partitions: this many bytes per category
#: on top of the implementation's relative allowance.
STATE_SLACK_BYTES = 64 * 1024


def relative_series_difference(values: Sequence[float | None], reference: Sequence[float | None]) -> tuple[float, int]:
    """The largest ``|a - b| / |b|`` over steps and the step it is at; a step where only one side is finite (an
    overflowed gradient, a skipped step) counts as infinitely different, where both are not finite as equal."""
    if len(values) != len(reference):
        raise ValueError(f"{len(values)} steps against {len(reference)} reference steps")
    worst, at = 0.0, 0
    for step, (a, b) in enumerate(zip(values, reference)):
        if a is None or b is None:
            raise ValueError(f"step {step} has no value")
        if not (math.isfinite(a) and math.isfinite(b)):
            diff = 0.0 if math.isfinite(a) == math.isfinite(b) else math.inf
        else:
            diff = abs(a - b) / max(abs(b), 1e-12)
        if diff > worst:
            worst, at = diff, step
    return worst, at


def tensor_differences(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, ``||p - ref||_2 / ||ref||_2`` (in float64)."""
    if params.keys() != reference.keys():
        missing = sorted(reference.keys() - params.keys())[:3]
        extra = sorted(params.keys() - reference.keys())[:3]
        raise ValueError(f"parameter names differ from the reference (missing {missing}, unexpected {extra})")
    out = {}
    for name, ref in reference.items():
        p = params[name]
        if p.shape != ref.shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, reference {tuple(ref.shape)}")
        ref64 = ref.double()
        out[name] = float((p.double() - ref64).norm()) / max(float(ref64.norm()), 1e-12)
    return out


def model_wide_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    diff = sum(float((params[n].double() - r.double()).pow(2).sum()) for n, r in reference.items())
    norm = sum(float(r.double().pow(2).sum()) for r in reference.values())
    return math.sqrt(diff / max(norm, 1e-24))


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def grad_norms(record: CaseRecord) -> list[float | None]:
    return [s.metrics.get("grad_norm") for s in record.steps]


def _series_check(
    name: str, values: Sequence[float | None], reference: Sequence[float | None], noise: float | None, p: Precision
) -> Check:
    figure, step = relative_series_difference(values, reference)
    bound = BOUNDS[name].of(p, noise)
    return Check(name=name, passed=figure <= bound, figure=figure, bound=bound, noise=noise, detail=f"step {step}")


def loss_check(case: CaseRecord, reference: CaseRecord, twin: CaseRecord | None) -> Check:
    noise = relative_series_difference(twin.losses(), reference.losses())[0] if twin else None
    return _series_check("loss", case.losses(), reference.losses(), noise, case.config.precision)


def grad_norm_check(case: CaseRecord, reference: CaseRecord, twin: CaseRecord | None) -> Check:
    """Not run when either side reports no gradient norm; the verdict then depends on the optimizer."""
    mine = grad_norms(case)
    who = case.config.implementation if None in mine else reference.config.implementation
    twin_norms = grad_norms(twin) if twin else None
    return norm_series_check(mine, grad_norms(reference), twin_norms, case.config.precision, who=who)


def norm_series_check(
    mine: Sequence[float | None],
    ref: Sequence[float | None],
    twin_norms: Sequence[float | None] | None,
    precision: Precision,
    *,
    who: str,
) -> Check:
    """Per-step gradient norms against the reference's, bounded by the twin's own difference (when it has norms)."""
    if None in mine or None in ref:
        return Check(name="grad_norm", passed=None, detail=f"{who} reports no grad_norm in Engine.metrics()")
    noise = (
        relative_series_difference(twin_norms, ref)[0] if twin_norms is not None and None not in twin_norms else None
    )
    return _series_check("grad_norm", mine, ref, noise, precision)


def parameter_check(
    params: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    twin: dict[str, torch.Tensor] | None,
    precision: Precision,
) -> Check:
    """Per tensor against the twin's per-tensor noise; model-wide against a fixed bound without a twin."""
    if twin is None:
        figure = model_wide_difference(params, reference)
        bound = MODEL_WIDE_BOUND[precision]
        return Check(
            name="parameters",
            passed=figure <= bound,
            figure=figure,
            bound=bound,
            detail="model-wide (no noise twin: per-tensor bounds need the measured noise)",
        )
    mine, noise = tensor_differences(params, reference), tensor_differences(twin, reference)
    bounds = {n: BOUNDS["parameters"].of(precision, noise[n]) for n in mine}
    worst = max(mine, key=lambda n: mine[n] / bounds[n])
    return Check(
        name="parameters",
        passed=all(mine[n] <= bounds[n] for n in mine),
        figure=mine[worst],
        bound=bounds[worst],
        noise=noise[worst],
        detail=worst,
    )


def ranks_check(case: CaseRecord) -> Check:
    return checksum_check(case.param_checksums)


def checksum_check(sums: list[str]) -> Check:
    """Every rank's final parameters hash the same."""
    if not sums:
        return Check(name="ranks", passed=None, detail="no per-rank checksums recorded")
    differing = [rank for rank, s in enumerate(sums) if s != sums[0]]
    detail = f"{len(sums)} ranks agree" if not differing else f"ranks {differing} differ from rank 0"
    return Check(name="ranks", passed=not differing, figure=float(len(differing)), bound=0.0, detail=detail)


def model_state_check(case: CaseRecord) -> Check:
    """Bytes per category (all locations) against the formulas' expectation for the declared layout."""
    caps = case.config.capabilities
    state = case.model_state
    if state is None or not state.expected:
        return Check(name="model_state", passed=None, detail="no model-state measurement")
    allowance = caps.state_allowance if caps is not None else 0.05
    if allowance is None:
        return Check(name="model_state", passed=None, detail="the implementation declares no byte layout to check")
    worst_name, worst_ratio, worst_measured, worst_expected = "", 0.0, 0, 0.0
    for category, expected in state.expected.items():
        measured = sum(state.measured.get(category, {}).values())
        off = abs(measured - expected)
        if category in ("gradients", "optimizer_state") and state.unused_parameters:
            # a parameter no rank used holds no gradient, nor AdamW state before its first one: an upper bound only
            off = max(measured - expected, 0)
        excess = off / (allowance * expected + STATE_SLACK_BYTES)
        if excess > worst_ratio:
            worst_name, worst_ratio, worst_measured, worst_expected = category, excess, measured, expected
    detail = (
        f"{worst_name}: {worst_measured:,} B held, {worst_expected:,.0f} B expected ({state.layout}) for stage "
        f"{case.config.stage} {case.config.precision} offload {case.config.offload}"
        if worst_name
        else "every category as expected"
    )
    return Check(name="model_state", passed=worst_ratio <= 1.0, figure=worst_ratio, bound=1.0, detail=detail)


@dataclass(frozen=True)
class ProbeEvidence:
    """A bf16 case's fp32 probe with what it is judged against: the fp32 group's DDP reference and noise twin,
    and the three runs' parameters after the probe's steps (``None`` where not stored)."""

    probe: Fp32Probe
    reference: CaseRecord | None
    twin: CaseRecord | None
    params_path: Path | None
    reference_params_path: Path | None
    twin_params_path: Path | None
    case_steps: int | None = None
    """The bf16 run's steps, when the probe was capped to fewer (the verdict then says where it compared)."""


def probe_checks(evidence: ProbeEvidence) -> list[Check]:
    """The fp32 probe judged as an fp32 case is: loss, gradient norm, parameters and ranks, with the fp32 bounds
    scaled by the fp32 twin's noise, over the probe's steps (the first ``Case.probe_steps`` of the reference's when
    the suite caps them). One check that could not run (``passed`` None) when the fp32 reference or a parameter file
    is missing."""
    probe, reference, twin = evidence.probe, evidence.reference, evidence.twin
    if reference is None or not reference.ok:
        why = "no fp32 DDP reference" if reference is None else f"the fp32 reference {reference.case_id} failed"
        return [Check(name="loss", passed=None, probe=True, detail=f"not run: {why}")]
    if evidence.params_path is None or evidence.reference_params_path is None:
        detail = f"not run: parameters after {len(probe.losses)} steps not stored"
        return [Check(name="parameters", passed=None, probe=True, detail=detail)]
    steps = len(probe.losses)
    ref_losses = reference.losses()[:steps]
    noise = relative_series_difference(twin.losses()[:steps], ref_losses)[0] if twin else None
    twin_norms = grad_norms(twin)[:steps] if twin else None
    checks = [
        _series_check("loss", probe.losses, ref_losses, noise, "fp32"),
        norm_series_check(
            probe.grad_norms, grad_norms(reference)[:steps], twin_norms, "fp32", who="the fp32 probe or its reference"
        ),
    ]
    twin_params = load_params(evidence.twin_params_path) if twin and evidence.twin_params_path else None
    checks.append(
        parameter_check(
            load_params(evidence.params_path), load_params(evidence.reference_params_path), twin_params, "fp32"
        )
    )
    if evidence.case_steps and steps < evidence.case_steps:  # a capped probe: say where its parameters met
        checks[-1] = checks[-1].model_copy(update={"detail": f"{checks[-1].detail}, after step {steps}"})
    checks.append(checksum_check(probe.param_checksums))
    return [c.model_copy(update={"probe": True}) for c in checks]


def _reasons(checks: list[Check]) -> list[str]:
    failed = [c for c in checks if c.passed is False]
    return [
        c.detail or c.label if c.name == "ranks" else f"{c.label} {c.figure:.3g} > bound {c.bound:.3g} ({c.detail})"
        for c in failed
    ]


def verdict(
    case: CaseRecord,
    reference: CaseRecord,
    twin: CaseRecord | None,
    *,
    params_path: Path | None,
    reference_params_path: Path | None,
    twin_params_path: Path | None,
    probe: ProbeEvidence | None = None,
) -> Equivalence:
    """The stored equivalence verdict: every check's figure, bound and noise, pass or fail, and why; with
    ``probe``, the fp32 probe's checks too (the case passes only when both runs do)."""
    precision = case.config.precision
    out = Equivalence(equivalent=False, reference_case=reference.case_id, twin_case=twin.case_id if twin else None)
    try:
        if params_path is None or reference_params_path is None:
            raise ValueError("final parameters were not stored")
        params, ref_params = load_params(params_path), load_params(reference_params_path)
        twin_params = load_params(twin_params_path) if twin is not None and twin_params_path is not None else None
        checks = [
            loss_check(case, reference, twin),
            grad_norm_check(case, reference, twin),
            parameter_check(params, ref_params, twin_params, precision),
            ranks_check(case),
            model_state_check(case),
        ]
        out.max_rel_param_diff = model_wide_difference(params, ref_params)
        probed = probe_checks(probe) if probe is not None else []
    except (ValueError, OSError, RuntimeError) as exc:
        out.reason = str(exc)
        return out
    out.checks = checks + probed
    out.max_rel_loss_diff = checks[0].figure
    out.worst_parameter, out.worst_parameter_rel_diff = checks[2].detail, checks[2].figure
    scale_blind = checks[1].passed is None and case.config.optimizer == "adamw"
    out.equivalent = not out.failed_checks and not scale_blind
    reasons = _reasons(checks)
    if probed and not reasons and _reasons(probed):
        reasons.append(f"{precision} run within its bounds (worst: {worst_margin(checks)})")
    reasons += _reasons(probed)
    if scale_blind:
        reasons.append(
            f"gradient scale unchecked: {checks[1].detail}, and AdamW hides a constant gradient scale "
            "(report grad_norm, or run with optimizer sgd)"
        )
    out.reason = "; ".join(reasons) or None
    return out


def worst_margin(checks: list[Check]) -> str:
    """The check nearest its bound, as ``parameters at 23% of its bound``."""
    measured = [c for c in checks if c.margin is not None]
    if not measured:
        return "no check measured"
    worst = max(measured, key=lambda c: c.margin or 0.0)
    return f"{worst.label} at {worst.margin:.0%} of its bound"


def not_checked(why: str) -> Equivalence:
    """A case that could not be compared counts as not equivalent, with the reason."""
    return Equivalence(equivalent=False, reason=f"not checked: {why}")
