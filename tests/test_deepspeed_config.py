"""A DeepSpeed JSON config as a suite: mapped onto every implementation, what does not map listed, bad files refused.

The config is the one DeepSpeed's documentation shows for ZeRO-3 with optimizer offload (bf16, AdamW,
a warm-up scheduler, bucket and prefetch sizes), in tests/data/ds_zero3_offload.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import zbench, zbench_many
from zbench.suite.deepspeed_config import DeepSpeedConfigError, map_config

CONFIG = Path(__file__).parent / "data" / "ds_zero3_offload.json"
SUITE = """
name: ds-config
device: cpu
models: [tiny]
implementations: [ddp, deepspeed, zero3, fsdp, fsdp1]
world_sizes: [2]
deepspeed_config: ds_zero3_offload.json
steps: 5
warmup_steps: 1
paired_rounds: 0
timeout_s: 300
"""
DEEPSPEED_ONLY = [
    "scheduler",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.overlap_comm",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_prefetch_bucket_size",
]


def test_the_documented_config_maps_onto_the_suite():
    mapped = map_config(json.loads(CONFIG.read_text()))
    assert mapped.suite == {
        "stage": 3,
        "precisions": ["bf16"],
        "offload": ["optimizer"],
        "micro_batch": 2,
        "grad_accum": 1,
        "grad_clip": 1.0,
        "optimizer": {"name": "adamw", "lr": 0.001, "weight_decay": 0.01},
    }
    assert mapped.deepspeed_only == DEEPSPEED_ONLY
    assert mapped.not_applied_by_deepspeed == ["scheduler"]


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"zero_optimisation": {"stage": 2}}, "did you mean 'zero_optimization'"),
        ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "did you mean 'overlap_comm'"),
        ({"zero_optimization": {"stage": 4}}, "stage must be 1, 2 or 3"),
        ({"bf16": {"enabled": True}}, "stage 0 is plain data parallelism"),
        ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "old spelling"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param needs stage 3"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "without offload_optimizer"),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}, "bf16.enabled: 'auto'"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, "reduce_bucket_size: 'auto'"),
        ({"zero_optimization": {"stage": 2}, "bf16": True}, "bf16 must be a mapping"),
        ({"zero_optimization": {"stage": 1}, "optimizer": {"type": "Lamb"}}, "optimizer type 'Lamb'"),
        ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both enabled"),
        ({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 0}, "positive integer"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}}, "allowed cpu, nvme, none"),
    ],
)
def test_what_cannot_be_mapped_is_refused(settings, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        map_config(settings)


@pytest.mark.heavy
def test_a_bad_config_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "typo.json").write_text(json.dumps({"zero_optimisation": {"stage": 2}}))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "unclipped.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0}))
    shutil.copy(CONFIG, tmp_path / "ds_zero3_offload.json")
    suites = {
        "typo": SUITE.replace("ds_zero3_offload.json", "typo.json"),
        "broken": SUITE.replace("ds_zero3_offload.json", "broken.json"),
        "missing": SUITE.replace("ds_zero3_offload.json", "nowhere.json"),
        "both": SUITE + "micro_batch: 4\n",
        "unclipped": SUITE.replace("ds_zero3_offload.json", "unclipped.json") + "grad_clip: 1.0\n",
        "staged": SUITE.replace("deepspeed, zero3", "{name: deepspeed, stages: [2]}, zero3"),
    }
    for name, text in suites.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    results = zbench_many([["run", str(tmp_path / f"{n}.yaml"), "--results", str(tmp_path / "r")] for n in suites])
    expected = ["did you mean 'zero_optimization'", "not a readable JSON file", "DeepSpeed config not found",
                "micro_batch set by both the suite and ds_zero3_offload.json",
                "grad_clip set by both the suite and unclipped.json",
                "stages (of an implementation entry) set by both the suite and ds_zero3_offload.json"]  # fmt: skip
    for r, text in zip(results, expected, strict=True):
        assert r.returncode == 2 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.heavy
def test_one_config_across_deepspeed_zero3_fsdp2_and_fsdp1(tmp_path):
    pytest.importorskip("deepspeed")
    shutil.copy(CONFIG, tmp_path / "ds_zero3_offload.json")
    (tmp_path / "s.yaml").write_text(SUITE)
    r = zbench("run", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"), "--report", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cases = {
        json.loads(p.read_text())["config"]["implementation"]: json.loads(p.read_text())
        for p in (tmp_path / "r").glob("*/cases/*.json")
        if "twin" not in p.name
    }
    for impl in ("deepspeed", "zero3", "fsdp", "fsdp1"):
        case = cases[impl]
        assert case["status"] == "ok" and case["equivalence"]["equivalent"], (impl, case.get("error"))
        config = case["config"]
        assert (config["stage"], config["precision"], config["micro_batch"], config["grad_clip"]) == (3, "bf16", 2, 1.0)
    assert cases["deepspeed"]["config"]["not_applied"] == ["scheduler"]
    assert cases["deepspeed"]["config"]["options"]["config"] == json.loads(CONFIG.read_text())
    assert (
        cases["zero3"]["config"]["offload"] == "optimizer" and cases["zero3"]["config"]["not_applied"] == DEEPSPEED_ONLY
    )
    for impl in ("fsdp", "fsdp1"):  # no optimizer-only offload there: run without, and say so
        assert cases[impl]["config"]["offload"] == "none"
        assert cases[impl]["config"]["not_applied"] == sorted([*DEEPSPEED_ONLY, "zero_optimization.offload_optimizer"])
    html = (tmp_path / "rep" / "index.html").read_text()
    assert html.count("not applied from the DeepSpeed config") == 4
