"""``zbench plan``: the ZeRO formulas per stage and offload mode, and the paper's 70B example."""

from __future__ import annotations

import json

import pytest

from tests.conftest import zbench
from zbench.cases.formulas import placement
from zbench.plan.memory import plan
from zbench.presets import PRESETS

PSI = PRESETS["gpt-70b"].num_parameters


def rows_by_name(**kw):
    return {r.name: r for r in plan(params=PSI, gpus=8, **kw)}


def test_bytes_per_parameter_match_the_zero_paper():
    rows = rows_by_name(precision="bf16")
    per_param = {name: r.model_state_device_bytes / PSI for name, r in rows.items()}
    assert per_param["DDP"] == pytest.approx(16)
    assert per_param["ZeRO-1"] == pytest.approx(4 + 12 / 8)
    assert per_param["ZeRO-2"] == pytest.approx(2 + 14 / 8)
    assert per_param["ZeRO-3"] == pytest.approx(16 / 8)
    assert rows_by_name(precision="fp32")["DDP"].model_state_device_bytes / PSI == pytest.approx(16)


def test_offload_moves_bytes_off_the_device_and_adds_only_the_host_gradient_partition():
    """Offload moves optimizer state and masters off the device; the host optimizer step needs its own fp32
    gradient partition (4 bytes/param/N), which at stages 2-3 replaces the device's gradient shard."""
    total = lambda p: sum(sum(v.values()) for v in p.values())
    device = lambda p: sum(v["device"] for v in p.values())
    for stage in (1, 2, 3):
        base = placement(params=PSI, world=8, stage=stage, precision="bf16", offload="none")
        for offload in ("optimizer", "nvme") + (("optimizer+params",) if stage == 3 else ()):
            moved = placement(params=PSI, world=8, stage=stage, precision="bf16", offload=offload)
            device_grads = base["gradients"]["device"] if stage >= 2 else 0
            assert total(moved) == pytest.approx(total(base) + 4 * PSI / 8 - device_grads)
            assert device(moved) < device(base)
            assert moved["optimizer_state"]["device"] == 0 and moved["master_weights"]["device"] == 0
            assert moved["gradients"]["host"] == pytest.approx(4 * PSI / 8)
    nvme = placement(params=PSI, world=8, stage=3, precision="bf16", offload="nvme")
    assert nvme["optimizer_state"]["disk"] > 0 and nvme["parameters"]["disk"] > 0


def test_fp32_offload_keeps_a_separate_host_master():
    fp32 = placement(params=PSI, world=8, stage=2, precision="fp32", offload="optimizer")
    assert fp32["master_weights"] == {"device": 0.0, "host": 4 * PSI / 8, "disk": 0.0}
    assert fp32["parameters"]["device"] == 4 * PSI


def test_70b_fits_8_gpus_of_24_gb_with_zero3_offload_but_not_with_ddp():
    rows = rows_by_name(precision="bf16", gpu_memory_bytes=24e9, cfg=PRESETS["gpt-70b"])
    assert rows["DDP"].fits is False
    assert rows["ZeRO-3"].fits is False
    assert rows["ZeRO-3 + offload optimizer+params"].fits is True


def test_cli_json(tmp_path):
    r = zbench("plan", "--model", "gpt-70b", "--gpus", "8", "--gpu-memory", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["parameters"] == PSI
    ddp = next(row for row in out["rows"] if row["name"] == "DDP")
    assert ddp["device_bytes"] / PSI == pytest.approx(16) and ddp["fits"] is False
    assert any(row["fits"] for row in out["rows"])


def test_cli_plans_a_published_architecture_by_its_own_shape():
    """Llama 2 70B by name (no transformers needed for the formulas): its exact parameter count and its largest
    stage-3 unit (a decoder layer with grouped-query attention and SwiGLU), not the GPT-shaped 70B preset's."""
    from zbench.cases.hf_models import arch

    llama = arch("llama-2-70b")
    r = zbench("plan", "--model", "llama-2-70b", "--gpus", "8", "--gpu-memory", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["parameters"] == llama.num_parameters == 68_976_648_192
    rows = {row["name"]: row for row in out["rows"]}
    assert rows["ZeRO-3"]["working_set_bytes"] == 3 * 2 * llama.largest_unit_parameters
    assert rows["ZeRO-3"]["working_set_bytes"] != 3 * 2 * PRESETS["gpt-70b"].largest_unit_parameters
    assert [name for name, row in rows.items() if row["fits"]] == [
        "ZeRO-3 + offload optimizer+params",
        "ZeRO-3 + offload nvme",
    ]
