"""World size 4 (gloo, CPU): every implementation's model-state bytes and communication volume against theory."""

from __future__ import annotations

import json

import pytest

from tests.conftest import zbench

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

SUITE = """
name: world4
device: cpu
models: tiny
world_sizes: 4
steps: 4
warmup_steps: 1
paired_rounds: 0
timeout_s: 300
implementations: [ddp, fsdp, torch_zero, zero1, zero2, zero3]
"""


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w4")
    (tmp / "s.yaml").write_text(SUITE)
    r = zbench("run", str(tmp / "s.yaml"), "--results", str(tmp / "results"), "--report", str(tmp / "rep"))
    cases = {
        json.loads(p.read_text())["config"]["implementation"]: json.loads(p.read_text())
        for p in (tmp / "results").glob("*/cases/*.json")
    }
    return r, cases


IMPLEMENTATIONS = ["ddp", "fsdp", "torch_zero", "zero1", "zero2", "zero3"]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_ok_and_equivalent(world4, impl):
    _, cases = world4
    case = cases[impl]
    assert case["status"] == "ok", case.get("error")
    assert case["equivalence"]["equivalent"], case["equivalence"]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_model_state_within_2_percent_of_formula(world4, impl):
    _, cases = world4
    state = cases[impl]["model_state"]
    assert abs(state["error_rel"]) <= 0.02, (impl, state["measured"], state["expected"])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_communication_within_5_percent_of_theory(world4, impl):
    _, cases = world4
    comms = cases[impl]["comms"]
    assert abs(comms["error_rel"]) <= 0.05, (
        impl,
        comms["elements_per_step"],
        comms["expected_elements"],
        comms["by_op"],
    )
