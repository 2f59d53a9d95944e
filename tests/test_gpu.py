"""The CUDA/NCCL/nvml path for real: skipped cleanly where there is no GPU (CI), run on a GPU machine.

One suite run at world 1 (a single GPU runs NCCL too) covers the GPU-only
instruments: nvml peak memory and energy, the CUDA allocator's peaks, CUDA-event
step timing and the phase split, and MFU from the GPU's known peak.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import zbench
from zbench.measure.nvml import NvmlSampler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SUITE = """
name: gpu-check
description: the GPU instruments, once
device: cuda
models: small
implementations: [ddp, fsdp, zero1, zero3]
world_sizes: 1
precisions: [bf16]
steps: 12
warmup_steps: 2
timeout_s: 300
noise_twin: false
fp32_probe: false
"""
#: The suite's cases: FSDP2 at both its stages. No noise twin and no fp32 probe, whose references would add cases.
CASES = 5


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("gpu")
    (tmp / "suite.yaml").write_text(SUITE)
    result = zbench("run", str(tmp / "suite.yaml"), "--results", str(tmp / "results"), "--report", str(tmp / "report"))
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = [p for p in (tmp / "results").iterdir() if p.is_dir()]
    return [json.loads(p.read_text()) for p in sorted((run_dir / "cases").glob("*.json"))]


def test_every_case_ok_and_equivalent(run):
    assert len(run) == CASES, [case["case_id"] for case in run]
    for case in run:
        assert case["status"] == "ok", case.get("error")
        assert case["equivalence"]["equivalent"], case["case_id"]


def test_nvml_memory_energy_and_mfu_recorded(run):
    for case in run:
        assert case["energy"]["available"], case["energy"]
        assert case["energy"]["peak_used_bytes"] > 0
        assert 0 < case["energy"]["energy_timed_j"] < case["energy"]["energy_j"]  # warm-up steps left out
        assert case["energy"]["energy_per_step_j"] > 0
        assert 0 < case["throughput"]["mfu"] < 1
        assert case["memory"]["kind"] == "cuda_allocated" and case["memory"]["peak_bytes"] > 0


def test_cuda_event_timing_and_phase_split(run):
    for case in run:
        ph = case["phases"]
        assert ph["clock"] == "CUDA events" and ph["device_step_s"] > 0, ph
        assert ph["forward_s"] > 0 and ph["backward_s"] > 0 and ph["optimizer_s"] > 0, (case["case_id"], ph)
        # the device's own clock agrees with the host's barrier-bracketed wall time, which also holds launch latency
        assert ph["device_step_s"] <= case["summary"]["step_time_median_s"] * 1.05


def test_nvml_sampler_reads_this_gpu():
    sampler = NvmlSampler(0, interval_s=0.01).start()
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        x = x @ x.T / 4096
    torch.cuda.synchronize()
    out = sampler.stop()
    assert out["available"] and out["peak_used_bytes"] >= x.numel() * 4
    assert out["samples"] > 0


def test_trace_on_fake_cuda_tensors_matches_the_formulas():
    """``zbench plan --trace --device cuda``: the implementations' CUDA branches (streams, pinned buffers) traced
    on fake CUDA tensors, which a CUDA build of torch allows (a CPU-only build traces on fake CPU tensors)."""
    r = zbench("plan", "--trace", "--model", "small", "--gpus", "8", "--device", "cuda", "-o", "none",
               "-o", "optimizer", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    for row in json.loads(r.stdout)["rows"]:
        assert row["trace"]["error"] is None, row["name"]
        assert row["trace"]["device"].startswith("cuda")
        traced = sum(sum(v.values()) for v in row["trace"]["state_bytes"].values())
        formula = sum(sum(v.values()) for v in row["formula"].values())
        assert traced == pytest.approx(formula, rel=0.05) or row["differences"], row["name"]


def test_fake_cuda_and_fake_cpu_traces_agree_on_states_and_traffic():
    """The same plan traced on fake CUDA tensors (a GPU visible) and on the fake-CPU stand-in (what a machine
    without a GPU traces on, either build of torch): identical model-state bytes and collectives; the peaks
    differ only where the stand-in counts host copies in the device's memory (printed: docs/methods.md#tracing)."""
    traces = {}
    for device in ("cuda", "cpu"):
        r = zbench("plan", "--trace", "--model", "small", "--gpus", "8", "--device", device, "-i", "zero3",
                   "-i", "fsdp", "-i", "ddp", "--json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        traces[device] = {row["name"]: row["trace"] for row in json.loads(r.stdout)["rows"]}
    assert traces["cuda"].keys() == traces["cpu"].keys()
    for name, on_cuda in traces["cuda"].items():
        on_cpu = traces["cpu"][name]
        assert on_cuda["error"] is None and on_cpu["error"] is None, name
        assert on_cuda["state_bytes"] == on_cpu["state_bytes"], name
        assert on_cuda["collectives"] == on_cpu["collectives"], name
        print(name, "peak on fake cuda", on_cuda["peak"], "on fake cpu", on_cpu["peak"])


OFFLOAD_SUITE = """
name: gpu-offload
description: the pinned-memory, side-stream and NVMe paths of ZeRO-Offload on a GPU
device: auto
models: small
implementations: [zero1, zero2, zero3]
offload: [optimizer, optimizer+params, nvme]
world_sizes: 1
precisions: [bf16]
steps: 8
warmup_steps: 2
timeout_s: 300
nvme_dir: {nvme}
noise_twin: false
fp32_probe: false
"""


def test_offload_modes_on_a_gpu_train_like_ddp(tmp_path):
    """DeviceToHost / HostToDevice on side streams into pinned buffers, the upload fences of host and NVMe
    masters, and ``device: auto`` resolving to cuda: every supported mode ends ok and equivalent."""
    (tmp_path / "nvme").mkdir()
    (tmp_path / "suite.yaml").write_text(OFFLOAD_SUITE.format(nvme=tmp_path / "nvme"))
    r = zbench("run", str(tmp_path / "suite.yaml"), "--results", str(tmp_path / "results"),
               "--report", str(tmp_path / "report"))  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run_dir,) = [p for p in (tmp_path / "results").iterdir() if p.is_dir()]
    cases = [json.loads(p.read_text()) for p in (run_dir / "cases").glob("*.json")]
    ran = [c for c in cases if c["status"] != "skipped"]
    assert {c["config"]["offload"] for c in ran} >= {"optimizer", "optimizer+params", "nvme"}
    for case in ran:
        assert case["config"]["device"] == "cuda"
        assert case["status"] == "ok" and case["equivalence"]["equivalent"], case["case_id"]


def test_world_size_beyond_the_gpus_is_bad_input(tmp_path):
    (tmp_path / "suite.yaml").write_text(
        SUITE.replace("world_sizes: 1", f"world_sizes: {torch.cuda.device_count() + 1}")
    )
    r = zbench("run", str(tmp_path / "suite.yaml"), "--results", str(tmp_path / "results"))
    assert r.returncode == 2 and "GPUs but" in r.stderr, r.stderr


def test_env_reports_the_gpus_and_nvml():
    r = zbench("env", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["gpus"] and info["gpu_count"] >= 1 and info["cuda_available"]
    assert info["nvml"]["available"] and info["nvml"]["driver"] and info["nvml"]["gpus"], info["nvml"]


def test_calibrate_on_this_gpu_and_against_the_datasheet_profile(tmp_path):
    """``zbench calibrate`` on the GPU (CUDA events, NCCL where there are two GPUs, pinned and pageable copies),
    with the links of a datasheet profile where one GPU cannot measure them, compared figure by figure."""
    from zbench.plan.simulate.cluster import load

    out = tmp_path / "gpu.yaml"
    base = "h100-sxm"
    r = zbench(
        "calibrate", "--quick", "--base", base, "--against", base, "--nvme-dir", str(tmp_path), "--out", str(out)
    )
    assert r.returncode == 0, r.stderr
    profile = load(str(out))
    cal = profile.calibration
    assert cal is not None and cal.device == torch.cuda.get_device_name(0) and cal.backend == "nccl"
    assert {"h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"} <= set(cal.copies_gb_s)
    assert {p.dtype for p in cal.matmul} >= {"bfloat16", "float32"}
    assert profile.peak_tflops == max(p.tflops for p in cal.matmul if p.dtype == "bfloat16")
    assert 0 < profile.memory_gib <= 200 and cal.op_call_us is not None and cal.op_call_us > 0
    if torch.cuda.device_count() > 1:
        assert {c.op for c in cal.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    else:
        assert cal.collectives == [] and "base profile" in profile.sources["intra_node"]
    assert f"{base} -> this calibration" in r.stderr
