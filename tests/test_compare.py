"""``zbench compare`` as a real subprocess: the JSON contract scripts rely on, and the table."""

from __future__ import annotations

import json

import pytest

from tests.conftest import zbench


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    return zbench(
        "compare",
        "ddp",
        "torch_zero",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--steps",
        "6",
        "--results",
        str(tmp),
        "--json",
    ), tmp


def test_json_contract(compared):
    result, tmp = compared
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    # bf16 by default: the fp32 reference and twin that torch_zero's fp32 probe is judged against come first
    assert [(c["implementation"], c["noise_twin"], c["precision"]) for c in out["cases"]] == [
        ("ddp", False, "fp32"),
        ("ddp", True, "fp32"),
        ("ddp", False, "bf16"),
        ("ddp", True, "bf16"),
        ("torch_zero", False, "bf16"),
    ]
    for case in out["cases"]:
        for key in (
            "implementation",
            "status",
            "step_time_median_s",
            "ratio_to_ddp",
            "peak_memory_bytes",
            "model_state_bytes",
            "max_rel_loss_diff",
            "equivalent",
        ):
            assert case[key] is not None, key
        assert case["status"] == "ok" and case["equivalent"] is True
    assert out["cases"][0]["ratio_to_ddp"] == 1.0
    assert out["cases"][4]["model_state_bytes"] < out["cases"][2]["model_state_bytes"]
    assert out["cases"][4]["failed_checks"] == []
    assert (tmp / out["run_id"] / "run.json").exists()


def test_table(tmp_path):
    result = zbench(
        "compare", "ddp", "ddp", "--device", "cpu", "--nproc", "1", "--steps", "4", "--results", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert "1.00x" in result.stdout  # DDP against itself
    for label in (
        "median step time",
        "ratio to DDP",
        "peak memory",
        "model state",
        "max rel loss diff",
        "equivalent to DDP",
    ):
        assert label in result.stdout
