"""The regression gate: statistics on synthetic samples, the paired-ratio verdicts on synthetic records, then
real runs with one implementation slowed (``zbench check``) and a real A/B of two checkouts (``zbench ab``).

How the gate behaves on a loaded machine, over many reruns, is measured in docs/methods.md#regression-gate
(the figures are too slow to take in a test run)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.conftest import make_case, zbench
from zbench.results.record import (
    CaseRecord,
    Equivalence,
    MemorySummary,
    ModelState,
    PairedTiming,
    StepSample,
    StepTimeSummary,
)
from zbench.results.run_info import Environment, RunInfo, SuiteInfo
from zbench.results.store import RunDir
from zbench.values import CATEGORIES, LOCATIONS
from zbench.verdicts.regress import Thresholds, check, compare_bytes, compare_times

T = Thresholds()
TRIALS = 200


def samples(rng: np.random.Generator, median: float, n: int = 37, cv: float = 0.04) -> list[float]:
    """Per-step times: log-normal noise around a median, with the odd slow outlier real machines produce.

    37 timed steps is what suites/nightly.yaml records per case (40 steps, 3 warm-up); with 4% noise the
    gate catches a 10% slowdown every time. (With only 17 samples it catches ~98%: give the gate samples.)
    """
    x = median * rng.lognormal(0.0, cv, n)
    x[rng.random(n) < 0.05] *= 1.5
    return x.tolist()


def test_ten_percent_slowdown_is_caught_every_time():
    rng = np.random.default_rng(0)
    verdicts = [compare_times(samples(rng, 0.1), samples(rng, 0.11), T)[0] for _ in range(TRIALS)]
    assert verdicts.count("regression") == TRIALS


def test_same_distribution_noise_rarely_cries_wolf():
    rng = np.random.default_rng(1)
    flagged = sum(compare_times(samples(rng, 0.1), samples(rng, 0.1), T)[0] is not None for _ in range(TRIALS))
    assert flagged / TRIALS <= 0.02, f"false-positive rate {flagged / TRIALS:.1%}"


def test_large_but_insignificant_change_is_not_a_regression():
    assert compare_times([0.1, 0.2], [0.2, 0.1], T)[0] is None


def test_speedup_is_reported_as_improvement():
    rng = np.random.default_rng(2)
    assert compare_times(samples(rng, 0.1), samples(rng, 0.08), T)[0] == "improvement"


def test_memory_thresholds():
    gib = 2**30
    assert compare_bytes(gib, 1.05 * gib, T)[0] == "regression"
    assert compare_bytes(gib, 1.01 * gib, T)[0] is None
    assert compare_bytes(10_000, 12_000, T)[0] is None  # +20% but below the absolute floor
    assert compare_bytes(gib, 0.9 * gib, T)[0] == "improvement"


CASE = make_case()


def test_peak_rss_noise_is_not_a_memory_regression_but_rss_growth_and_device_growth_are():
    """An unchanged CPU rerun's peak RSS moved +8.6 MB (2.6%) on tiny; device peaks repeat to the byte."""
    from zbench.verdicts.regress import case_findings

    base = record(CASE, times=[0.1] * 10, peak=345_817_088)
    noisy = record(CASE, times=[0.1] * 10, peak=354_811_904)
    assert case_findings([base], noisy, T) == []
    grown = record(CASE, times=[0.1] * 10, peak=345_817_088 + (48 << 20))
    assert [f.metric for f in case_findings([base], grown, T)] == ["peak_memory"]
    on_gpu = [
        r.model_copy(update={"memory": MemorySummary(kind="cuda_allocated", peak_bytes=r.peak_bytes)})
        for r in (base, noisy)
    ]
    assert [f.metric for f in case_findings(on_gpu[:1], on_gpu[1], T)] == ["peak_memory"]


def record(case, *, times, paired=None, peak=2**30, equivalent=True, status="ok") -> CaseRecord:
    steps = [StepSample(step=i, loss=1.0, step_time_s=t, warmup=False) for i, t in enumerate(times)]
    state = {c: {loc: 0 for loc in LOCATIONS} for c in CATEGORIES}
    return CaseRecord(
        config=case,
        status=status,
        steps=steps,
        summary=StepTimeSummary(step_time_median_s=float(np.median(times))),
        memory=MemorySummary(kind="rss", peak_bytes=peak),
        model_state=ModelState(measured=state, measured_total=2**20, expected_total=2**20),
        equivalence=Equivalence(equivalent=equivalent, reason="loss differs"),
        paired=paired,
    )


def fake_run(root, run_id, *, peak=2**30, times=None, equivalent=True, status="ok", records=(), **environment):
    run = RunDir(root, run_id)
    env = Environment(host="h", cpu_count=2, **environment)
    run.start(RunInfo(run_id=run_id, suite=SuiteInfo(name="s"), environment=env))
    for r in records or [record(CASE, times=times or [0.1] * 10, peak=peak, equivalent=equivalent, status=status)]:
        run.write_case(r)
    return run


ZERO2 = make_case(implementation="zero2", stage=2)


def paired_run(root, run_id, rng, *, machine=1.0, slowdown=1.0, rounds=200, cv=0.15, **environment):
    """DDP (the reference) and zero2 (paired with a DDP copy, ~1.1x its step) on a machine ``machine`` times
    slower than usual, every step with ``cv`` noise of its own: what a loaded machine does to a run."""
    ddp = machine * 0.1 * rng.lognormal(0, cv, 10)
    reference = machine * 0.1 * rng.lognormal(0, cv, rounds)
    case = slowdown * machine * 0.11 * rng.lognormal(0, cv, rounds)
    records = [
        record(CASE, times=ddp.tolist()),
        record(
            ZERO2,
            times=(slowdown * machine * 0.11 * rng.lognormal(0, cv, 10)).tolist(),
            paired=PairedTiming(case_s=case.tolist(), reference_s=reference.tolist()),
        ),
    ]
    return fake_run(root, run_id, records=records, **environment)


def test_machine_twice_as_slow_is_drift_not_a_regression(tmp_path):
    rng = np.random.default_rng(3)
    base = paired_run(tmp_path, "a", rng)
    result = check(paired_run(tmp_path, "b", rng, machine=2.0), [base], T)
    assert result.verdict == "pass", result.findings
    drift = [f for f in result.findings if f.kind == "drift"]
    assert [f.case_id for f in drift] == [CASE.case_id] and drift[0].change_pct > 50
    assert "not gated" in drift[0].detail


def test_paired_ratio_catches_a_ten_percent_slowdown_on_a_slower_machine(tmp_path):
    rng = np.random.default_rng(4)
    base = paired_run(tmp_path, "a", rng)
    result = check(paired_run(tmp_path, "b", rng, machine=0.7, slowdown=1.1), [base], T)
    assert result.verdict == "fail"
    (finding,) = result.failed
    assert (finding.case_id, finding.metric, finding.kind) == (ZERO2.case_id, "step_time_vs_ddp", "regression")
    assert 5 < finding.change_pct < 15 and "absolute median -2" in finding.detail  # 0.7 x 1.1 = 0.77


def test_paired_gate_false_alarms_and_detections_on_noisy_rounds(tmp_path):
    """400 rounds a side at 15% per-step noise, machines 0.5-3x as fast: unchanged runs never flagged, a 10%
    slowdown caught at least 19 times in 20 (the issue's bar), 40 trials each.

    The estimate has to clear the 5% minimum effect, not just be significant, and the baseline's own error is
    shared by every trial: this baseline's median ratio came out 1.9% high, so the slowed runs' estimated
    change centres near 8%, with a 1.3% standard error on each side's median; about 1 in 40 lands under 5%."""
    rng = np.random.default_rng(5)
    base = paired_run(tmp_path, "base", rng, rounds=400)
    alarms = sum(
        check(paired_run(tmp_path, f"u{i}", rng, machine=rng.uniform(0.5, 3), rounds=400), [base], T).failed != []
        for i in range(40)
    )
    caught = sum(
        check(
            paired_run(tmp_path, f"s{i}", rng, machine=rng.uniform(0.5, 3), slowdown=1.1, rounds=400), [base], T
        ).verdict
        == "fail"
        for i in range(40)
    )
    assert alarms == 0 and caught >= 38, (alarms, caught)


DDP_SHAPED = make_case(implementation="tests.plugins.faulty:FAULTY")


def loaded_run(root, run_id, rng, *, load, slowdown=1.0, rounds=300, cv=0.15):
    """What the 2-core experiment saw (docs/methods.md#measured-on-a-loaded-machine): busy neighbours for a
    fraction ``load`` of the run make zero2's step up to 10% dearer *relative to DDP* (its collectives wait on
    descheduled peers), while a DDP-shaped engine's ratio stays at 1; ``slowdown`` slows the DDP-shaped one."""

    def paired(ratio):
        reference = 0.1 * rng.lognormal(0, cv, rounds)
        return PairedTiming(
            case_s=(ratio * 0.1 * rng.lognormal(0, cv, rounds)).tolist(), reference_s=reference.tolist()
        )

    records = [
        record(CASE, times=(0.1 * (1 + load) * rng.lognormal(0, cv, 10)).tolist()),
        record(ZERO2, times=[0.11] * 10, paired=paired(1.1 * (1 + 0.1 * load))),
        record(DDP_SHAPED, times=[0.1] * 10, paired=paired(slowdown)),
    ]
    return fake_run(root, run_id, records=records)


def test_pooled_baseline_holds_where_the_load_moves_an_engines_ratio(tmp_path):
    """The noise the gate must ignore: zero2's ratio to DDP grows up to 10% with the load, so against one quiet
    baseline run unchanged reruns are flagged. The bug it must catch: a DDP-shaped engine 10% slower. Five
    baseline runs at varying load show zero2's spread (its allowance widens) and not the other's (it stays 5%)."""
    rng = np.random.default_rng(8)
    quiet = loaded_run(tmp_path, "quiet", rng, load=0.0)
    pooled = [loaded_run(tmp_path, f"b{i}", rng, load=load) for i, load in enumerate(rng.uniform(0, 1, 5))]
    unchanged = [check(loaded_run(tmp_path, f"u{i}", rng, load=rng.uniform(0, 1)), pooled, T) for i in range(20)]
    slowed = [
        check(loaded_run(tmp_path, f"s{i}", rng, load=rng.uniform(0, 1), slowdown=1.1), pooled, T) for i in range(20)
    ]
    assert sum(r.failed != [] for r in unchanged) == 0, [r.failed for r in unchanged if r.failed]
    flagged = [{f.case_id for f in r.failed} for r in slowed]
    assert sum(DDP_SHAPED.case_id in f for f in flagged) >= 19 and not any(ZERO2.case_id in f for f in flagged)
    allowance = unchanged[0].time_allowance_pct
    assert allowance[DDP_SHAPED.case_id] == T.time_pct and allowance[ZERO2.case_id] > 8, allowance
    # ...and the design it replaces: one quiet baseline run cries wolf on zero2
    alarms = sum(
        check(loaded_run(tmp_path, f"q{i}", rng, load=rng.uniform(0, 1)), [quiet], T).failed != [] for i in range(20)
    )
    assert alarms >= 5, alarms


def test_without_paired_rounds_the_gate_says_it_fell_back_to_absolute_times(tmp_path):
    rng = np.random.default_rng(6)
    base = paired_run(tmp_path, "a", rng)
    unpaired = record(ZERO2, times=(0.2 * rng.lognormal(0, 0.02, 10)).tolist())
    result = check(fake_run(tmp_path, "b", records=[unpaired]), [base], T)
    (finding,) = result.failed
    assert finding.metric == "step_time" and "no paired rounds in the candidate" in finding.detail


def test_environment_differences_are_shown_with_the_verdict(tmp_path):
    from zbench.verdicts import check as check_mod

    rng = np.random.default_rng(7)
    base = paired_run(tmp_path, "a", rng, torch="2.12.0", load_average_1m=0.2)
    result = check(paired_run(tmp_path, "b", rng, torch="2.13.0", load_average_1m=3.5), [base], T)
    assert result.environment_changes == {"torch": ("2.12.0", "2.13.0"), "load_average_1m": (0.2, 3.5)}
    assert "torch 2.12.0 -> 2.13.0; load_average_1m 0.2 -> 3.5" in check_mod.markdown(result)
    newer_driver = paired_run(tmp_path, "c", rng, nvml={"available": True, "driver": "580.65"})
    older = paired_run(tmp_path, "d", rng, nvml={"available": True, "driver": "575.57"})
    assert check(newer_driver, [older], T).environment_changes["driver"] == ("575.57", "580.65")


def test_check_finds_memory_growth_equivalence_and_status_failures(tmp_path):
    base = fake_run(tmp_path, "a")
    assert check(fake_run(tmp_path, "b"), [base], T).verdict == "pass"
    mem = check(fake_run(tmp_path, "c", peak=int(1.05 * 2**30)), [base], T)
    assert mem.verdict == "fail" and [f.metric for f in mem.failed] == ["peak_memory"]
    eq = check(fake_run(tmp_path, "d", equivalent=False), [base], T)
    assert eq.verdict == "fail" and eq.failed[0].metric == "equivalence"
    crash = check(fake_run(tmp_path, "e", status="oom"), [base], T)
    assert crash.verdict == "fail" and crash.failed[0].candidate == "oom"


def test_check_cli_gates_stored_runs_end_to_end(tmp_path):
    """``zbench check`` as a user runs it, on stored runs (the fast tier's gate; real runs: the heavy tier below):
    a 30% slower zero2 fails naming the case, with a markdown summary; a rerun of the same speed passes."""
    rng = np.random.default_rng(11)
    base = paired_run(tmp_path, "base", rng)
    slow, same = paired_run(tmp_path, "slow", rng, slowdown=1.3), paired_run(tmp_path, "same", rng)
    md = tmp_path / "summary.md"
    r = zbench("check", str(slow.path), "--baseline", str(base.path), "--json", "--markdown", str(md))
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "fail"
    regressed = {f["case_id"] for f in out["findings"] if f["kind"] == "regression"}
    assert regressed and all("zero2" in c for c in regressed), out["findings"]
    assert "zero2" in md.read_text() and "zbench check" in md.read_text()
    ok = zbench("check", str(same.path), "--baseline", str(base.path))
    assert ok.returncode == 0, ok.stdout + ok.stderr


# --- two real runs ------------------------------------------------------------------------------------------

SUITE = """
name: gate
device: cpu
models: tiny
world_sizes: 2
steps: 12
warmup_steps: 2
implementations: [ddp, {name: "tests.plugins.faulty:FAULTY", options: {fault: slow}}]
noise_twin: false
# FAULTY runs DDP's code, so its step over the paired DDP copy's stays near 1 however loaded the machine
# is; the slowed build takes twice as long (+100%). This test is about the mechanics, not the machine's
# noise (docs/methods.md#regression-gate has the figures), so it gates at +25%.
regression: {time_pct: 25}
"""


# Three suite runs (a minute and more on two cores): the heavy tier. The fast tier gates end to end through
# tests/test_records.py (``zbench check`` of a stored run) and judges synthetic records here.
@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """Baseline, the same suite with one implementation slowed, and an unchanged rerun; each in its own results dir."""
    tmp = tmp_path_factory.mktemp("gate")
    (tmp / "gate.yaml").write_text(SUITE)
    runs = []
    for i, slowdown in enumerate(("0", "100", "0")):
        os.environ["ZBENCH_TEST_SLOWDOWN_PCT"] = slowdown
        try:
            r = zbench("run", str(tmp / "gate.yaml"), "--results", str(tmp / f"run{i}"), "--report", str(tmp / "rep"))
        finally:
            del os.environ["ZBENCH_TEST_SLOWDOWN_PCT"]
        assert r.returncode == 0, r.stderr
        runs.append(next((tmp / f"run{i}").iterdir()))
    return runs


@pytest.mark.heavy
def test_slowed_run_fails_the_gate_naming_the_case(three_runs, tmp_path):
    base, slow, _ = three_runs
    md = tmp_path / "summary.md"
    r = zbench("check", str(slow), "--baseline", str(base), "--json", "--markdown", str(md))
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "fail"
    names = {(f["case_id"], f["metric"], f["kind"]) for f in out["findings"]}
    assert any("FAULTY" in c and m == "step_time_vs_ddp" and k == "regression" for c, m, k in names), names
    assert not any(c.startswith("tiny-ddp") and k == "regression" for c, _, k in names)
    assert "FAULTY" in md.read_text() and "zbench check" in md.read_text()


@pytest.mark.heavy
def test_unchanged_rerun_passes(three_runs):
    base, _, again = three_runs
    r = zbench("check", str(again), "--baseline", str(base), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["verdict"] == "pass"


@pytest.mark.heavy
def test_baseline_runs_pool_and_foreign_suites_are_refused(three_runs, tmp_path):
    base, slow, again = three_runs
    r = zbench("check", str(slow), "--baseline", str(base), "--baseline", str(again.parent), "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["baselines"] == [base.name, again.name]
    (allowance,) = out["time_allowance_pct"].items()  # the reference (DDP) is not gated
    assert "FAULTY" in allowance[0] and allowance[1] == 25  # two runs: their spread is not counted
    other = tmp_path / "other" / base.name
    shutil.copytree(base, other)
    info = json.loads((other / "run.json").read_text())
    info["suite"]["name"] = "another"
    (other / "run.json").write_text(json.dumps(info))
    r = zbench("check", str(slow), "--baseline", str(other))
    assert r.returncode == 2 and "a run of suite 'another'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.heavy
def test_check_without_any_baseline_is_bad_input(three_runs):
    base, _, _ = three_runs
    r = zbench("check", str(base))
    assert r.returncode == 2 and "no baseline" in r.stderr


@pytest.mark.heavy
def test_report_draws_history_with_the_regression_marked(three_runs, tmp_path):
    import shutil

    history = tmp_path / "history"
    for run in three_runs:
        shutil.copytree(run, history / run.name)
    r = zbench("report", str(history), "--report", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "rep" / "index.html").read_text()
    assert "History (3 runs of this suite on this machine)" in html
    assert "Regressions against the run before" in html and "FAULTY" in html.split("Regressions against")[1][:2000]


@pytest.mark.heavy
def test_history_loader_keys_points_by_commit(three_runs, tmp_path):
    from zbench.report.history import case_history

    series = case_history([RunDir(r.parent, r.name) for r in three_runs])
    slow = next(v for k, v in series.items() if "FAULTY" in k)
    assert len(slow) == 3 and slow[1].regressed == ["step_time_vs_ddp"] and not slow[0].regressed
    assert all(p.label for p in slow)


# --- A/B: two checkouts, one job --------------------------------------------------------------------------


def copy_checkout(dest, *, slowdown_honoured: bool):
    """A second checkout of this code (what `git worktree add` gives a PR job); optionally with a faulty
    plug-in that ignores the slowdown variable: the base of a PR that made FAULTY slower."""
    import shutil

    from tests.conftest import ROOT

    for name in ("zbench", "implementations"):
        shutil.copytree(ROOT / name, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        ROOT / "tests" / "plugins", dest / "tests" / "plugins", ignore=shutil.ignore_patterns("__pycache__")
    )
    (dest / "tests" / "__init__.py").write_text("")
    faulty = dest / "tests" / "plugins" / "faulty.py"
    text = faulty.read_text()
    if not slowdown_honoured:
        text = text.replace('float(os.environ.get("ZBENCH_TEST_SLOWDOWN_PCT", "0"))', "0.0")
        assert "pct = 0.0\n" in text
    faulty.write_text(text)
    return dest


@pytest.fixture(scope="module")
def ab_runs(tmp_path_factory):
    """``zbench ab`` twice: head slowed 2x against an unslowed base, then against an identical base."""
    tmp = tmp_path_factory.mktemp("ab")
    (tmp / "gate.yaml").write_text(SUITE)
    fast_base = copy_checkout(tmp / "fast-base", slowdown_honoured=False)
    same_base = copy_checkout(tmp / "same-base", slowdown_honoured=True)
    os.environ["ZBENCH_TEST_SLOWDOWN_PCT"] = "100"
    try:
        slowed = zbench(
            "ab", str(tmp / "gate.yaml"), "--base", str(fast_base), "--rounds", "2", "--results", str(tmp / "r1"),
            "--json", "--markdown", str(tmp / "comment.md"),
        )  # fmt: skip
        same = zbench(
            "ab", str(tmp / "gate.yaml"), "--base", str(same_base), "--rounds", "1", "--results", str(tmp / "r2")
        )
    finally:
        del os.environ["ZBENCH_TEST_SLOWDOWN_PCT"]
    return tmp, slowed, same


@pytest.mark.heavy
def test_ab_fails_the_slower_head_and_writes_the_comment(ab_runs):
    tmp, slowed, _ = ab_runs
    assert slowed.returncode == 1, slowed.stderr[-3000:]
    out = json.loads(slowed.stdout)
    (finding,) = [f for f in out["findings"] if f["kind"] == "regression"]
    assert "FAULTY" in finding["case_id"] and finding["metric"] == "step_time_vs_ddp" and finding["change_pct"] > 25
    assert out["compared_cases"] == 2 and out["baselines"] == ["base"] and out["candidate"] == "head"
    comment = (tmp / "comment.md").read_text()
    assert comment.startswith("### :x: zbench A/B (base vs head)") and "FAULTY" in comment
    # rounds alternate: two suite runs per side, each side's under its own directory
    assert len(list((tmp / "r1" / "base").iterdir())) == 2 and len(list((tmp / "r1" / "head").iterdir())) == 2


@pytest.mark.heavy
def test_ab_of_identical_checkouts_passes(ab_runs):
    _, _, same = ab_runs
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-3000:]
    assert "PASS: run head vs baseline base" in same.stdout


def test_ab_with_a_base_that_is_not_a_checkout_is_bad_input(tmp_path):
    (tmp_path / "gate.yaml").write_text(SUITE)
    r = zbench("ab", str(tmp_path / "gate.yaml"), "--base", str(tmp_path))
    assert r.returncode == 2 and "not a zbench checkout" in r.stderr and len(r.stderr.strip().splitlines()) == 1
