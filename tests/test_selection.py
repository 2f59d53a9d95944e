"""Fitting a suite to the machine without editing it: ``--set``, ``-k``, ``--dry-run`` and ``world_sizes: [auto]``.

The GPU scaling suite, made to run here on the command line alone: the dry run lists exactly the cases the
real run then runs (the selected ones and the DDP references they are judged against), with each one's fit
check. Bad overrides and patterns are one line and exit 2.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import ROOT, zbench, zbench_many
from zbench.suite.config import from_dict, with_overrides
from zbench.suite.selection import select

SCALING = str(ROOT / "suites" / "scaling.yaml")
#: scaling.yaml (8 GPUs, gpt-125m ... gpt-2.7b) made small enough for two CPU ranks: only the command line changes.
HERE = ["--set", "world_sizes=[2]", "--set", "device=cpu", "--set", "models=[tiny]", "--set", "seq_len=32"]
HERE += ["--set", "steps=3", "--set", "warmup_steps=1", "--set", "timeout_s=300"]


def listed_cases(stdout: str) -> list[str]:
    return re.findall(r"^│ (tiny-\S+)", stdout, flags=re.MULTILINE)


@pytest.mark.heavy
def test_the_issue_command_lists_what_it_would_run():
    r = zbench("run", SCALING, "--set", "world_sizes=[2]", "--set", "device=cpu", "-k", "gpt-125m", "--dry-run")
    assert r.returncode == 0, r.stderr
    ids = re.findall(r"^│ (gpt-\S+)", r.stdout, flags=re.MULTILINE)
    assert ids and all(i.startswith("gpt-125m-") and "-w2-" in i for i in ids)
    assert "gpt-125m-ddp-s0-w2-bf16-none" in ids and "gpt-125m-zero3-s3-w2-bf16-none" in ids
    assert "nothing was run" in r.stdout and re.search(r"\d+ would run, \d+ skipped", r.stdout)


@pytest.mark.heavy
def test_a_dry_run_lists_exactly_what_the_run_then_runs(tmp_path):
    """``-k zero2`` keeps zero2 and the DDP reference and noise twin it is judged against (in bf16 the fp32 ones its
    fp32 probe is judged against too), nothing else."""
    dry = zbench("run", SCALING, *HERE, "-k", "zero2", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    listed = listed_cases(dry.stdout)
    assert listed == [
        "tiny-ddp-s0-w2-fp32-none",
        "tiny-ddp-s0-w2-fp32-none-twin",
        "tiny-ddp-s0-w2-bf16-none",
        "tiny-ddp-s0-w2-bf16-none-twin",
        "tiny-zero2-s2-w2-bf16-none",
    ]
    assert not (tmp_path / "results").exists()
    ran = zbench(
        "run", SCALING, *HERE, "-k", "zero2", "--results", str(tmp_path / "results"), "--report", str(tmp_path)
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "results").glob("*/cases/*.json")]
    assert sorted(r["case_id"] for r in records) == sorted(listed)
    zero2 = next(r for r in records if r["config"]["implementation"] == "zero2")
    assert zero2["equivalence"]["equivalent"] and zero2["config"]["steps"] == 3


def test_a_case_too_big_for_the_machine_says_so():
    r = zbench("run", SCALING, "--set", "world_sizes=[2]", "--set", "device=cpu", "-k", "gpt-2.7b-ddp", "--dry-run")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if "gpt-2.7b-ddp-s0-w2-bf16-none " in line)
    assert row.rstrip(" │").endswith("NO") and "predicted not to fit" in r.stdout


@pytest.mark.heavy
def test_bad_overrides_and_patterns_are_one_line_and_exit_2():
    bad = {
        "nomatch": (["-k", "zer0"], "-k zer0: matches none of the suite's"),
        "unknown": (["--set", "world_size=[2]"], "unknown key 'world_size'"),
        "value": (["--set", "world_sizes=[0]"], "world_sizes.0"),
        "form": (["--set", "world_sizes"], "--set: expected KEY=VALUE"),
        "nested": (["--set", "steps.count=3"], "--set steps.count: steps is not a mapping"),
    }
    results = zbench_many([["run", SCALING, "--set", "device=cpu", *args, "--dry-run"] for args, _ in bad.values()])
    for (name, (_, message)), r in zip(bad.items(), results, strict=True):
        assert r.returncode == 2 and message in r.stderr, (name, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)


def test_overrides_reach_into_mappings_and_leave_the_rest():
    data = {"optimizer": {"name": "adamw", "lr": 0.001}, "steps": 20}
    out = with_overrides(data, {"optimizer.lr": 0.01, "seq_len": 64}, "s.yaml")
    assert out == {"optimizer": {"name": "adamw", "lr": 0.01}, "steps": 20, "seq_len": 64}
    assert data["optimizer"]["lr"] == 0.001  # the file's own mapping is not touched


def test_auto_world_size_is_two_cpu_ranks(tmp_path):
    from zbench.suite import preflight
    from zbench.suite.config import from_flags

    config = from_dict(
        {"device": "cpu", "models": ["tiny"], "implementations": ["ddp"], "world_sizes": ["auto", 2, 3]}, source="t"
    )
    suite = preflight.prepare(from_flags(config))
    assert suite.config.world_sizes == [2, 3]
    assert {c.world_size for c in suite.cases} == {2, 3}


def test_selection_keeps_the_references_of_what_it_keeps():
    from zbench.suite import preflight
    from zbench.suite.config import from_flags

    config = from_dict(
        {
            "device": "cpu",
            "models": ["tiny", "small"],
            "implementations": ["ddp", "zero1", "zero3"],
            "world_sizes": [2],
            "precisions": ["fp32", "bf16"],
        },
        source="t",
    )
    cases = preflight.prepare(from_flags(config)).cases
    kept = [c.case_id for c in select(cases, ["small-zero3*bf16*"])]
    assert kept == [  # with the fp32 reference and twin its fp32 probe is judged against
        "small-ddp-s0-w2-fp32-none",
        "small-ddp-s0-w2-fp32-none-twin",
        "small-ddp-s0-w2-bf16-none",
        "small-ddp-s0-w2-bf16-none-twin",
        "small-zero3-s3-w2-bf16-none",
    ]
    assert [c.case_id for c in select(cases, ["tiny-ddp-s0-w2-fp32-none-twin"])] == ["tiny-ddp-s0-w2-fp32-none-twin"]
    assert select(cases, []) == cases


def _expanded(**overrides):
    from zbench.suite import preflight
    from zbench.suite.config import from_flags

    suite = {"device": "cpu", "models": ["tiny"], "implementations": ["ddp", "zero2"], "world_sizes": [2]}
    return preflight.prepare(from_flags(from_dict({**suite, **overrides}, source="t"))).cases


def test_bf16_cases_get_an_fp32_probe_and_its_fp32_references_come_first():
    bf16_only = _expanded(precisions=["bf16"])
    assert [(c.case_id, c.fp32_probe) for c in bf16_only] == [
        ("tiny-ddp-s0-w2-fp32-none", False),  # added: the probe's reference and twin, before the group they judge
        ("tiny-ddp-s0-w2-fp32-none-twin", False),
        ("tiny-ddp-s0-w2-bf16-none", False),
        ("tiny-ddp-s0-w2-bf16-none-twin", False),
        ("tiny-zero2-s2-w2-bf16-none", True),
    ]
    # listed after bf16, fp32 still runs first (its reference judges the probes); no second fp32 reference
    both = [(c.case_id, c.fp32_probe) for c in _expanded(precisions=["bf16", "fp32"])]
    assert both == [
        ("tiny-ddp-s0-w2-fp32-none", False),
        ("tiny-ddp-s0-w2-fp32-none-twin", False),
        ("tiny-zero2-s2-w2-fp32-none", False),
        ("tiny-ddp-s0-w2-bf16-none", False),
        ("tiny-ddp-s0-w2-bf16-none-twin", False),
        ("tiny-zero2-s2-w2-bf16-none", True),
    ]
    assert {c.probe_steps for c in _expanded(precisions=["bf16"])} == {
        None
    }  # 20 steps: within the default cap, nothing to keep apart
    off = _expanded(precisions=["bf16"], fp32_probe=False)
    assert [(c.case_id, c.fp32_probe) for c in off] == [
        ("tiny-ddp-s0-w2-bf16-none", False),
        ("tiny-ddp-s0-w2-bf16-none-twin", False),
        ("tiny-zero2-s2-w2-bf16-none", False),
    ]


def test_a_long_case_probes_only_the_capped_steps_against_fp32_runs_of_that_length_or_kept_there():
    capped = _expanded(precisions=["bf16"], steps=30, fp32_probe_steps=12)
    assert [(c.case_id, c.steps, c.fp32_probe, c.probe_steps) for c in capped] == [
        ("tiny-ddp-s0-w2-fp32-none", 12, False, None),  # added for the probes: trained for their 12 steps alone
        ("tiny-ddp-s0-w2-fp32-none-twin", 12, False, None),
        ("tiny-ddp-s0-w2-bf16-none", 30, False, None),
        ("tiny-ddp-s0-w2-bf16-none-twin", 30, False, None),
        ("tiny-zero2-s2-w2-bf16-none", 30, True, 12),
    ]
    both = _expanded(precisions=["bf16", "fp32"], steps=30, fp32_probe_steps=12)
    assert [(c.case_id, c.steps, c.fp32_probe, c.probe_steps) for c in both] == [
        ("tiny-ddp-s0-w2-fp32-none", 30, False, 12),  # the suite's own: keeps its parameters after step 12 as well
        ("tiny-ddp-s0-w2-fp32-none-twin", 30, False, 12),
        ("tiny-zero2-s2-w2-fp32-none", 30, False, None),
        ("tiny-ddp-s0-w2-bf16-none", 30, False, None),
        ("tiny-ddp-s0-w2-bf16-none-twin", 30, False, None),
        ("tiny-zero2-s2-w2-bf16-none", 30, True, 12),
    ]
    probed, short_reference = capped[-1], capped[0]
    assert probed.probe_reference_keys == (both[0].reference_key, short_reference.reference_key)
    uncapped = _expanded(precisions=["bf16"], steps=30, fp32_probe_steps=None)
    assert {(c.steps, c.probe_steps) for c in uncapped} == {(30, None)}
    fp32_only = _expanded(precisions=["fp32"], steps=30, fp32_probe_steps=12)  # no probes, nothing to keep
    assert {c.probe_steps for c in fp32_only} == {None}
