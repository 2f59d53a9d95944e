"""``zbench plan``'s formulas against DeepSpeed's own memory estimators, term by term.

Where DeepSpeed is installed: for gpt-125m ... gpt-70b at 8 and 64 GPUs (8 per node), bf16, every
offload mode, DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` (what its ``*_all_live`` helpers print, fed the model's
parameter count and largest layer, built on the meta device) are compared with
``zbench.cases.formulas.placement``. They are not equal, and the test pins down exactly why, so that a
change on either side shows up (docs/methods.md#deepspeeds-estimators):

- GPU: DeepSpeed adds a fp32 gradient partition (4Ψ/N) at stage 2, which DeepSpeed creates for the
  optimizer step and frees after it (its peak, not what it holds between steps), counts 18Ψ/N
  at stage 3 where the formulas count 16Ψ/N, and adds the largest layer in fp32 (4·L) at stage 3, a
  working-set allowance the formulas report separately;
- host, per node: with offload DeepSpeed's figure is the formulas' times its ``additional_buffer_factor``
  (1.5) at stage 3, and at stage 2 the larger of that and a full fp32 model per process (4Ψ per GPU,
  its model-loading peak); without offload it counts the fp32 model (or largest layer) each process
  builds on the host before partitioning, which the formulas leave out.

``python -m tests.test_deepspeed_estimators`` prints the table in the docs.
"""

from __future__ import annotations

import pytest

from zbench.cases.formulas import placement

MODELS = ["gpt-125m", "gpt-350m", "gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b", "gpt-30b", "gpt-70b"]
GPUS = (8, 64)
PER_NODE = 8
BUFFER = 1.5  # DeepSpeed's additional_buffer_factor default
#: (stage, our offload mode) -> DeepSpeed's estimator arguments
MODES = {
    (2, "none"): {"cpu_offload": False},
    (2, "optimizer"): {"cpu_offload": True},
    (3, "none"): {"cpu_offload": False, "cpu_offload_params": False},
    (3, "optimizer"): {"cpu_offload": True, "cpu_offload_params": False},
    (3, "optimizer+params"): {"cpu_offload": True, "cpu_offload_params": True},
}


def shape(model: str) -> tuple[int, int]:
    """(parameters, largest layer's parameters) as DeepSpeed's ``*_all_live`` helpers count them."""
    import torch

    from zbench.cases.models import build_model

    with torch.device("meta"):
        m = build_model(model, seed=0)
    total = sum(p.numel() for p in m.parameters())
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    return total, largest


def deepspeed_estimate(stage: int, offload: str, psi: int, largest: int, gpus: int) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU) from DeepSpeed's estimator."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes = gpus // PER_NODE
    if stage == 2:
        return estimate_zero2_model_states_mem_needs(psi, PER_NODE, nodes, **MODES[(stage, offload)])
    host, gpu, _ = estimate_zero3_model_states_mem_needs(psi, largest, PER_NODE, nodes, **MODES[(stage, offload)])
    return host, gpu


def ours(stage: int, offload: str, psi: int, gpus: int) -> tuple[float, float]:
    """(host bytes per node, GPU bytes per GPU) from the formulas, bf16 with fp32 masters."""
    p = placement(params=psi, world=gpus, stage=stage, precision="bf16", offload=offload, master_weights=True)
    return PER_NODE * sum(c["host"] for c in p.values()), sum(c["device"] for c in p.values())


def explained(stage: int, offload: str, psi: int, largest: int, gpus: int) -> tuple[float, float]:
    """DeepSpeed's figures rebuilt from the formulas' and the differences named in the module docstring."""
    host, gpu = ours(stage, offload, psi, gpus)
    shard = psi / gpus
    if stage == 2 and offload == "none":
        return PER_NODE * 4 * psi * BUFFER, gpu + 4 * shard  # fp32 model per process; fp32 gradient partition
    if stage == 2:
        return psi * max(4 * gpus, 16) * BUFFER, gpu  # the larger of the formulas' host state and loading
    if offload == "none":
        return PER_NODE * 4 * largest * BUFFER, gpu + 2 * shard + 4 * largest  # 18 vs 16 per Ψ/N; largest layer
    return host * BUFFER, gpu + 4 * largest


CASES = [(m, s, o, n) for m in MODELS for (s, o) in MODES for n in GPUS]


@pytest.fixture(scope="module")
def shapes():
    pytest.importorskip("deepspeed")
    return {m: shape(m) for m in MODELS}


@pytest.mark.parametrize("model,stage,offload,gpus", CASES, ids=lambda v: str(v))
def test_deepspeeds_estimate_is_the_formulas_plus_the_named_differences(shapes, model, stage, offload, gpus):
    psi, largest = shapes[model]
    ds_host, ds_gpu = deepspeed_estimate(stage, offload, psi, largest, gpus)
    host, gpu = explained(stage, offload, psi, largest, gpus)
    assert ds_gpu == pytest.approx(gpu, abs=2), (ds_gpu, gpu, ours(stage, offload, psi, gpus))
    assert ds_host == pytest.approx(host, abs=2), (ds_host, host, ours(stage, offload, psi, gpus))


def table() -> str:
    gib = 2**30
    rows = [
        "| model | GPUs | stage / offload | GPU: zbench / DeepSpeed | host per node: zbench / DeepSpeed |",
        "|---|---:|---|---:|---:|",
    ]
    for model in MODELS:
        psi, largest = shape(model)
        for gpus in GPUS:
            for stage, offload in MODES:
                host, gpu = ours(stage, offload, psi, gpus)
                ds_host, ds_gpu = deepspeed_estimate(stage, offload, psi, largest, gpus)
                rows.append(
                    f"| {model} | {gpus} | {stage} / {offload} | {gpu / gib:,.2f} / {ds_gpu / gib:,.2f} GiB "
                    f"| {host / gib:,.1f} / {ds_host / gib:,.1f} GiB |"
                )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
