"""DeepSpeed's ZeRO against DDP on gloo at world 2 and 3: stages 1-3, fp32 and bf16, every offload mode it offers.

Runs where DeepSpeed is installed (the ``deepspeed`` extra, which ``.ci/run`` installs); skipped
otherwise. One suite run (a real ``zbench run``) with gradient accumulation and clipping: every case
must be equivalent to DDP (loss, gradient norm, the fp32 master parameters). DeepSpeed declares no
byte layout (its gradient buffers vary by stage, precision and offload), so the model-state check
says it did not run; its measured bytes are stored and shown. Without DeepSpeed every case is skipped
with the install hint (tests/test_units.py).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import zbench

pytest.importorskip("deepspeed")

SUITE = """
name: deepspeed
device: cpu
models: tiny
implementations: [ddp, deepspeed]
world_sizes: [2, 3]
precisions: [fp32, bf16]
offload: [none, optimizer, optimizer+params]
steps: 5
warmup_steps: 1
micro_batch: 2
grad_accum: 2
grad_clip: 1.0
timeout_s: 300
optimizer: {name: adamw, lr: 0.001, weight_decay: 0.01}
"""
OFFLOADS = {1: ("none", "optimizer"), 2: ("none", "optimizer"), 3: ("none", "optimizer", "optimizer+params")}
KEYS = [(s, w, p, o) for s in (1, 2, 3) for w in (2, 3) for p in ("fp32", "bf16") for o in OFFLOADS[s]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed")
    (tmp / "s.yaml").write_text(SUITE)
    r = zbench(
        "run", str(tmp / "s.yaml"), "--results", str(tmp / "results"), "--report", str(tmp / "rep"), timeout=1500
    )
    cases = [json.loads(p.read_text()) for p in (tmp / "results").glob("*/cases/*.json")]
    return r, {
        (c["config"]["stage"], c["config"]["world_size"], c["config"]["precision"], c["config"]["offload"]): c
        for c in cases
        if c["config"]["implementation"] == "deepspeed"
    }


@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"s{k[0]}-w{k[1]}-{k[2]}-{k[3]}")
def test_equivalent_to_ddp(run, key):
    _, cases = run
    case = cases[key]
    assert case["status"] == "ok", case.get("error")
    equivalence = case["equivalence"]
    assert equivalence["equivalent"], equivalence
    checks = {c["name"]: c for c in equivalence["checks"]}
    assert checks["model_state"]["passed"] is None  # no declared layout: said, not passed
    if key[2] == "fp32":
        assert checks["loss"]["figure"] <= 1e-6, checks["loss"]
    measured = case["model_state"]["measured"]
    assert (measured["optimizer_state"]["host"] > 0) == (key[3] != "none")
    assert (measured["parameters"]["host"] > 0) == (key[3] == "optimizer+params")


def test_the_run_passes(run):
    result, _ = run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
