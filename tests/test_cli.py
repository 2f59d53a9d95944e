"""The command line's shared conventions, as a user meets them in real subprocesses.

``--version``; ``--results`` (or ``$ZBENCH_RESULTS``) accepted the same way by every command that reads
results; choices listed in ``--help``; flags shown as flags; ``plan`` and ``compare`` sharing a default
precision; a heartbeat off a terminal; final parameters deleted unless kept; ``zbench gc``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import zbench as zbench_pkg
from tests.conftest import ROOT, child_env, zbench
from zbench.cli import compare, options, plan

SUITE = """
name: cli
device: cpu
models: tiny
implementations: [ddp, torch_zero]
world_sizes: 1
steps: 40
warmup_steps: 2
"""


@pytest.fixture(scope="module")
def env_run(tmp_path_factory):
    """One run whose results directory comes from $ZBENCH_RESULTS, with parameters kept and a fast heartbeat."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "cli.yaml").write_text(SUITE)
    env = child_env(ZBENCH_RESULTS=str(tmp / "results"), ZBENCH_HEARTBEAT_S="0.2", COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "zbench", "run", str(tmp / "cli.yaml"), "--report", str(tmp / "rep"), "--keep-params"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    return proc, tmp


def test_version():
    r = zbench("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"zbench {zbench_pkg.__version__}"


def test_results_from_the_environment_and_params_kept(env_run):
    proc, tmp = env_run
    assert proc.returncode == 0, proc.stderr
    (run,) = list((tmp / "results").iterdir())
    assert sorted(p.name for p in (run / "params").iterdir()) == [
        "tiny-ddp-s0-w1-fp32-none-twin.pt",
        "tiny-ddp-s0-w1-fp32-none.pt",
        "tiny-torch_zero-s1-w1-fp32-none.pt",
    ]
    for case in (run / "cases").glob("*.json"):
        assert json.loads(case.read_text())["params_file"].startswith("params/")


def test_heartbeat_off_a_terminal(env_run):
    proc, _ = env_run
    # e.g. "[1/3] tiny-ddp-s0-w1-fp32-none: step 7/40, 3 s" (DDP, its noise twin, torch_zero); a quiet machine
    # trains tiny's 40 steps in ~0.4 s, two heartbeats, and torch_zero's paired rounds add more after its last step
    beats = [line for line in proc.stderr.splitlines() if line.startswith("[") and ": step " in line]
    assert beats, proc.stderr
    assert all(line.rstrip().endswith(" s") for line in beats)


@pytest.mark.heavy
def test_every_results_reader_takes_the_option_the_argument_and_the_variable(env_run, tmp_path):
    _, tmp = env_run
    results = str(tmp / "results")
    by_option = zbench("report", "--results", results, "--report", str(tmp_path / "a"))
    by_argument = zbench("report", results, "--report", str(tmp_path / "b"))
    by_env = subprocess.run(
        [sys.executable, "-m", "zbench", "report", "--report", str(tmp_path / "c")],
        cwd=ROOT,
        env=child_env(ZBENCH_RESULTS=results),
        capture_output=True,
        text=True,
        timeout=300,
    )
    for r in (by_option, by_argument, by_env):
        assert r.returncode == 0, r.stderr
    for name in "abc":
        assert (tmp_path / name / "index.html").exists()
    check = zbench("check", "--results", results)
    assert check.returncode == 2 and "no baseline" in check.stderr  # found the run, and said why it cannot gate
    both = zbench("check", results, "--results", str(tmp_path))
    assert both.returncode == 2 and "results given twice" in both.stderr


def test_gc_keeps_the_newest_runs_of_each_suite(env_run, tmp_path):
    _, tmp = env_run
    (run,) = list((tmp / "results").iterdir())
    results = tmp_path / "results"
    for i in range(4):  # four runs of the same suite, oldest first
        copy = results / f"2026010{i}-000000-aaaaaa"
        shutil.copytree(run, copy)
        info = json.loads((copy / "run.json").read_text())
        info.update(run_id=copy.name, started_at=f"2026-01-0{i + 1}T00:00:00+00:00")
        (copy / "run.json").write_text(json.dumps(info))
    dry = zbench("gc", str(results), "--keep", "1", "--dry-run")
    assert dry.returncode == 0 and dry.stderr.count("would remove") == 3 and len(list(results.iterdir())) == 4
    r = zbench("gc", "--results", str(results), "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert [p.name for p in results.iterdir()] == ["20260103-000000-aaaaaa"]
    assert zbench("gc", str(results), "--keep", "0").returncode == 2


def test_help_lists_choices_and_flags():
    for command, choices in (("compare", ("fp32|bf16|fp16", "auto|cpu|cuda")), ("plan", ("fp32|bf16|fp16",))):
        r = zbench(command, "--help")
        assert r.returncode == 0
        for choice in choices:
            assert choice in r.stdout, (command, r.stdout)
        assert "--json " in r.stdout and "<bool>" not in r.stdout and "--json BOOLEAN" not in r.stdout
    check = zbench("check", "--help").stdout
    assert "--baseline latest|DIR" in check and "--baseline-runs N" in check and "list[str]" not in check


def test_plan_and_compare_share_the_default_precision():
    import inspect

    def default(fn) -> str:
        return inspect.signature(fn).parameters["precision"].default

    assert default(plan.plan) == default(compare.compare) == options.DEFAULT_PRECISION


def run_in_process(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """``zbench ARGV`` through the installed entry point, in this process (no torch import to pay again)."""
    from zbench.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code, capsys.readouterr().out


def test_list_names_every_builtin_every_preset_and_the_suites(capsys, monkeypatch):
    from zbench.implementations import BUILTIN
    from zbench.presets import PRESETS

    code, out = run_in_process(["list", "--suites", str(ROOT / "suites")], capsys, monkeypatch)
    assert code == 0
    assert all(f"│ {name} " in out for name in BUILTIN) and all(f"│ {name} " in out for name in PRESETS)
    assert "suites/smoke.yaml" in out


def test_env_json_says_what_zbench_sees(capsys, monkeypatch):
    import torch

    code, out = run_in_process(["env", "--json"], capsys, monkeypatch)
    info = json.loads(out)
    assert code == 0 and info["torch"] == torch.__version__ and info["backends"]["gloo"] is True
    code, out = run_in_process(["env"], capsys, monkeypatch)
    assert code == 0 and f"torch: {torch.__version__}" in out
