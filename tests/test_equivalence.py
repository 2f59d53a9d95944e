"""The equivalence verdict's arithmetic on synthetic records: each check catches its planted bug, and ignores noise
that the noise twin measured (fast, in-process; the real-run bug matrix is tests/test_wrong_implementations.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_case
from zbench.protocol import Capabilities
from zbench.results.record import CaseRecord, ModelState, StepSample
from zbench.verdicts import equivalence

REF = {"w": torch.tensor([1.0, -2.0, 3.0]), "key_bias": torch.tensor([0.5, 0.5]), "ln": torch.tensor([1.0, 1.0])}
STATE = {"parameters": 1000.0, "gradients": 1000.0, "optimizer_state": 2000.0, "master_weights": 0.0}


def record(losses, norms, *, checksums=("a", "a"), master_bytes=0, twin=False, **case) -> CaseRecord:
    measured = {k: {"device": int(v), "host": 0, "disk": 0} for k, v in STATE.items()}
    measured["master_weights"]["device"] = master_bytes
    return CaseRecord(
        config=make_case(steps=len(losses), noise_twin=twin, capabilities=Capabilities(), **case),
        status="ok",
        steps=[
            StepSample(step=i, loss=loss, step_time_s=0.1, warmup=False, metrics={} if g is None else {"grad_norm": g})
            for i, (loss, g) in enumerate(zip(losses, norms))
        ],
        model_state=ModelState(measured=measured, expected=STATE, measured_total=4000, expected_total=4000),
        param_checksums=list(checksums),
    )


def judge(tmp_path, case, params, *, twin_params=None, twin=None, reference=None):
    reference = reference or record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8])
    paths = {}
    for name, p in (("case", params), ("ref", REF), ("twin", twin_params)):
        if p is not None:
            torch.save(p, tmp_path / f"{name}.pt")
            paths[name] = tmp_path / f"{name}.pt"
    return equivalence.verdict(
        case,
        reference,
        twin,
        params_path=paths["case"],
        reference_params_path=paths["ref"],
        twin_params_path=paths.get("twin"),
    )


def noisy(key_bias_shift: float, everything: float = 0.0) -> dict[str, torch.Tensor]:
    """The reference moved by rounding-sized noise, and the zero-gradient key bias moved a lot (as AdamW does)."""
    out = {n: t * (1 + everything) for n, t in REF.items()}
    out["key_bias"] = REF["key_bias"] + key_bias_shift
    return out


def checks(eq) -> dict[str, bool | None]:
    return {c.name: c.passed for c in eq.checks}


def test_identical_training_passes_every_check(tmp_path):
    eq = judge(tmp_path, record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8]), dict(REF))
    assert eq.equivalent and set(checks(eq).values()) == {True}


def test_gradient_scale_bug_invisible_to_loss_and_parameters_is_caught_by_the_gradient_norm(tmp_path):
    """A sum instead of a mean at world 2: AdamW leaves loss and parameters alone, the norm doubles."""
    eq = judge(tmp_path, record([2.0, 1.5, 1.2], [2.0, 1.8, 1.6]), dict(REF))
    assert not eq.equivalent and checks(eq)["loss"] and checks(eq)["parameters"]
    assert checks(eq)["grad_norm"] is False and "grad_norm" in eq.reason and eq.failed_checks == ["grad_norm"]


def test_missing_gradient_norm_fails_under_adamw_but_not_under_sgd(tmp_path):
    blind = judge(tmp_path, record([2.0, 1.5, 1.2], [None, None, None]), dict(REF))
    assert not blind.equivalent and checks(blind)["grad_norm"] is None and "gradient scale unchecked" in blind.reason
    sgd = judge(tmp_path, record([2.0, 1.5, 1.2], [None, None, None], optimizer="sgd"), dict(REF))
    assert sgd.equivalent


def test_zero_gradient_noise_the_twin_also_shows_is_ignored_but_a_small_tensor_bug_is_not(tmp_path):
    twin = record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8], twin=True)
    # correct: the key bias wandered as far as it does in the twin; everything else agrees to rounding
    ok = judge(tmp_path, record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8]), noisy(0.05), twin_params=noisy(0.04), twin=twin)
    assert ok.equivalent, ok.reason
    # the same noise, plus a LayerNorm 1% off: per tensor, not diluted by the rest of the model
    bad_params = noisy(0.05)
    bad_params["ln"] = REF["ln"] * 1.01
    bad = judge(tmp_path, record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8]), bad_params, twin_params=noisy(0.04), twin=twin)
    assert not bad.equivalent and bad.worst_parameter == "ln" and bad.failed_checks == ["parameters"]


def test_without_a_twin_the_parameter_check_is_model_wide_and_says_so(tmp_path):
    eq = judge(tmp_path, record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8]), dict(REF))
    (param,) = [c for c in eq.checks if c.name == "parameters"]
    assert "no noise twin" in param.detail and param.bound == equivalence.MODEL_WIDE_BOUND["fp32"]


def test_bounds_scale_with_the_measured_noise(tmp_path):
    """bf16-sized loss noise in the twin lets a bf16-sized difference pass; the same difference fails in fp32."""
    ref = record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8], precision="bf16")
    case = record([2.0, 1.5075, 1.2003], [1.0, 0.9, 0.8], precision="bf16")  # 5e-3: above bf16's least bound
    quiet_twin = record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8], twin=True, precision="bf16")
    noisy_twin = record([2.0, 1.5009, 1.2001], [1.0, 0.9, 0.8], twin=True, precision="bf16")  # 6e-4
    assert not checks(judge(tmp_path, case, dict(REF), twin_params=dict(REF), twin=quiet_twin, reference=ref))["loss"]
    loose = judge(tmp_path, case, dict(REF), twin_params=dict(REF), twin=noisy_twin, reference=ref)
    assert checks(loose)["loss"], loose.reason
    (loss,) = [c for c in loose.checks if c.name == "loss"]
    assert loss.bound == pytest.approx(20 * 0.0009 / 1.5) and loss.noise == pytest.approx(0.0009 / 1.5)


def test_a_rank_that_drifts_is_caught_by_the_checksums(tmp_path):
    eq = judge(tmp_path, record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8], checksums=("a", "b")), dict(REF))
    assert not eq.equivalent and eq.failed_checks == ["ranks"] and "ranks [1]" in eq.reason


def test_model_state_catches_a_half_size_master_copy(tmp_path):
    """bf16 masters where the layout needs fp32: half the bytes; padding-sized differences pass."""
    global STATE
    saved = STATE
    STATE = {**saved, "master_weights": 400_000.0}
    try:
        ok = judge(tmp_path, record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8], master_bytes=400_512), dict(REF))
        half = judge(tmp_path, record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8], master_bytes=200_000), dict(REF))
    finally:
        STATE = saved
    assert checks(ok)["model_state"]
    assert not half.equivalent and half.failed_checks == ["model_state"] and "master_weights" in half.reason


@pytest.mark.parametrize(
    ("values", "reference", "expected"),
    [([1.0, float("inf")], [1.0, float("inf")], 0.0), ([1.0, 2.0], [1.0, float("nan")], float("inf"))],
)
def test_skipped_steps_compare_by_finiteness(values, reference, expected):
    assert equivalence.relative_series_difference(values, reference)[0] == expected


def test_unreadable_parameters_are_not_equivalent(tmp_path):
    eq = equivalence.verdict(
        record([1.0], [1.0]), record([1.0], [1.0]), None, params_path=None, reference_params_path=None,
        twin_params_path=None,
    )  # fmt: skip
    assert not eq.equivalent and "not stored" in eq.reason


def probe_verdict(tmp_path, bf16_params, probe_params, *, probe_losses=(2.0, 1.5, 1.2), reference32=True):
    """A bf16 case within its (wide) bounds, with an fp32 probe judged against an fp32 reference and twin."""
    from zbench.results.record import Fp32Probe

    bf16_ref = record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8], precision="bf16")
    bf16_twin = record([2.0, 1.51, 1.21], [1.0, 0.9, 0.8], precision="bf16", twin=True)
    ref32 = record([2.0, 1.5, 1.2], [1.0, 0.9, 0.8])
    twin32 = record([2.0, 1.5, 1.2000001], [1.0, 0.9, 0.8], twin=True)
    files = {}
    for name, p in (("p16", bf16_params), ("r16", REF), ("t16", noisy(0.2, 0.01)), ("p32", probe_params)):
        torch.save(p, tmp_path / f"{name}.pt")
        files[name] = tmp_path / f"{name}.pt"
    torch.save(noisy(1e-3, 1e-7), tmp_path / "t32.pt")
    probe = Fp32Probe(losses=list(probe_losses), grad_norms=[1.0, 0.9, 0.8], param_checksums=["a", "a"], seconds=0.5)
    evidence = equivalence.ProbeEvidence(
        probe=probe,
        reference=ref32 if reference32 else None,
        twin=twin32,
        params_path=files["p32"],
        reference_params_path=files["r16"],  # the fp32 reference's parameters: REF as well
        twin_params_path=tmp_path / "t32.pt",
    )
    return equivalence.verdict(
        record([2.0, 1.505, 1.205], [1.0, 0.9, 0.8], precision="bf16"),
        bf16_ref,
        bf16_twin,
        params_path=files["p16"],
        reference_params_path=files["r16"],
        twin_params_path=files["t16"],
        probe=evidence,
    )


def test_a_bug_inside_the_bf16_noise_is_caught_by_the_fp32_probe(tmp_path):
    """A 1% error on one tensor: well inside bf16's bounds (the twin moved everything by 1%), far outside fp32's."""
    wrong = {**REF, "ln": REF["ln"] * 1.01}
    eq = probe_verdict(tmp_path, wrong, wrong)
    bf16 = {c.name: c.passed for c in eq.checks if not c.probe}
    assert set(bf16.values()) == {True}, eq.checks  # the bf16 run alone would pass it
    assert not eq.equivalent and eq.failed_checks == ["fp32 probe parameters"]
    assert eq.reason.startswith("bf16 run within its bounds (worst: ") and "fp32 probe parameters" in eq.reason


def test_a_correct_fp32_probe_keeps_the_case_equivalent_and_a_missing_reference_is_said(tmp_path):
    eq = probe_verdict(tmp_path, noisy(0.1, 0.005), noisy(1e-4, 1e-8))
    assert eq.equivalent, eq.reason
    assert {c.label for c in eq.checks if c.probe} == {
        "fp32 probe loss",
        "fp32 probe grad_norm",
        "fp32 probe parameters",
        "fp32 probe ranks",
    }
    late = probe_verdict(tmp_path, noisy(0.1, 0.005), noisy(1e-4, 1e-8), probe_losses=(2.0, 1.5, 1.2 * 1.001))
    assert not late.equivalent and late.failed_checks == ["fp32 probe loss"]  # a 0.1% loss change at the last step
    unjudged = probe_verdict(tmp_path, noisy(0.1, 0.005), noisy(1e-4, 1e-8), reference32=False)
    probe = [c for c in unjudged.checks if c.probe]
    assert unjudged.equivalent and len(probe) == 1 and probe[0].passed is None
    assert probe[0].detail == "not run: no fp32 DDP reference"


def test_a_capped_probe_is_judged_on_the_reference_s_first_steps(tmp_path):
    """A probe of 2 steps against 3-step fp32 runs: the reference's and twin's first two steps (and the parameters
    they kept after step 2) judge it, whatever their third step did; the parameter check says where it compared."""
    from zbench.results.record import Fp32Probe

    ref32 = record([2.0, 1.5, 9.0], [1.0, 0.9, 5.0])  # a third step no 2-step probe could match
    twin32 = record([2.0, 1.5000001, 9.1], [1.0, 0.9, 5.0], twin=True)
    torch.save(REF, tmp_path / "r.pt")
    torch.save(noisy(1e-3, 1e-7), tmp_path / "t.pt")

    def judged(probe_params, losses):
        torch.save(probe_params, tmp_path / "p.pt")
        probe = Fp32Probe(losses=losses, grad_norms=[1.0, 0.9], param_checksums=["a", "a"], seconds=0.5)
        evidence = equivalence.ProbeEvidence(
            probe, ref32, twin32, tmp_path / "p.pt", tmp_path / "r.pt", tmp_path / "t.pt", case_steps=3
        )
        return {c.name: c for c in equivalence.probe_checks(evidence)}

    good = judged(noisy(1e-4, 1e-8), [2.0, 1.5])
    assert all(c.passed for c in good.values()), good
    assert good["parameters"].detail.endswith(", after step 2") and good["loss"].probe
    bad = judged({**REF, "ln": REF["ln"] * 1.01}, [2.0, 1.5 * 1.001])
    assert bad["parameters"].passed is False and bad["loss"].passed is False
