"""FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``) against DDP on gloo: every sharding strategy,
fp32 and bf16 at world 2, fp32 at world 3 (uneven shards; how they shard does not depend on the precision).

One suite run (a real ``zbench run``): FSDP1's ``NO_SHARD`` (stage 0), ``SHARD_GRAD_OP`` (stage 2) and
``FULL_SHARD`` (stage 3), FSDP2's ``reshard_after_forward=False`` (stage 2) and ``True`` (stage 3), the latter
also with its option ``prefetch: 2`` (each unit issuing the next two units' gathers ahead), with gradient
accumulation and clipping, next to DDP and its noise twin.
Each case must be equivalent to DDP (loss, gradient norm, parameters, model-state bytes), hold the
model states its layout implies within 2% (stage 2 holds sharded parameters between steps:
``Capabilities.parameters_sharded_from_stage``), and send what its declared pattern says. FSDP1's CPU
offload needs an accelerator, so on CPU those cases are skipped with that reason.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import zbench

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

SUITE = """
name: fsdp-strategies
device: cpu
models: tiny
implementations: [ddp, fsdp1, fsdp, {name: fsdp, stages: [3], offload: [none], options: {prefetch: 2}}]
world_sizes: [2, 3]
precisions: [fp32, bf16]
offload: [none, optimizer+params]
steps: 6
warmup_steps: 1
paired_rounds: 0
micro_batch: 2
grad_accum: 2
grad_clip: 1.0
timeout_s: 300
optimizer: {name: adamw, lr: 0.001, weight_decay: 0.01}
"""
STRATEGIES = {
    ("fsdp1", 0): "NO_SHARD",
    ("fsdp1", 2): "SHARD_GRAD_OP",
    ("fsdp1", 3): "FULL_SHARD",
    ("fsdp", 2): "fsdp2-no-reshard-after-forward",
    ("fsdp", 3): "fsdp2-reshard-after-forward",
    ("fsdp-prefetch2", 3): "fsdp2-prefetching-two-units",
}
KEYS = [(*strategy, 2, precision) for strategy in STRATEGIES for precision in ("fp32", "bf16")]
KEYS += [(*strategy, 3, "fp32") for strategy in STRATEGIES]
#: Every case at world 2, the fp32 ones at world 3 (with their DDP references, which ``-k`` always keeps).
SELECT = ["-k", "*-w2-*", "-k", "*-w3-fp32-*"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    (tmp / "s.yaml").write_text(SUITE)
    r = zbench("run", str(tmp / "s.yaml"), *SELECT, "--results", str(tmp / "results"), "--report", str(tmp / "rep"))
    cases = [json.loads(p.read_text()) for p in (tmp / "results").glob("*/cases/*.json")]
    return r, {
        (_name(c["config"]), c["config"]["stage"], c["config"]["world_size"], c["config"]["precision"],
         c["config"]["offload"]): c
        for c in cases
        if c["config"]["implementation"] != "ddp"
    }  # fmt: skip


def _name(config: dict) -> str:
    """The implementation, with its prefetch depth where the suite set one (``STRATEGIES``' first key)."""
    depth = config["options"].get("prefetch")
    return config["implementation"] + (f"-prefetch{depth}" if depth else "")


def _id(key: tuple[str, int, int, str]) -> str:
    return f"{STRATEGIES[key[:2]]}-w{key[2]}-{key[3]}"


@pytest.mark.parametrize("key", KEYS, ids=_id)
def test_equivalent_to_ddp(run, key):
    _, cases = run
    case = cases[(*key, "none")]
    assert case["status"] == "ok", case.get("error")
    equivalence = case["equivalence"]
    assert equivalence["equivalent"], equivalence
    if key[3] == "fp32":  # the same arithmetic as DDP up to the order of a sum
        loss = next(c for c in equivalence["checks"] if c["name"] == "loss")
        assert loss["figure"] <= 1e-6, loss


@pytest.mark.parametrize("key", KEYS, ids=_id)
def test_model_states_and_traffic_as_declared(run, key):
    """The declared volume is one micro-batch's; with 2 micro-batches stage 3 gathers for each (forward and
    backward, the root once), while ``no_sync`` (FSDP2: ``set_requires_gradient_sync``) defers the reduction to
    the last one; stage 2 sends 2Ψ for one micro-batch."""
    _, cases = run
    case = cases[(*key, "none")]
    assert abs(case["model_state"]["error_rel"]) <= 0.02, case["model_state"]
    comms, psi = case["comms"], case["model_parameters"]
    expected = comms["expected_elements"]
    if key[0] in ("fsdp", "fsdp-prefetch2"):  # FSDP2 pads each parameter's rows to a multiple of the world
        padded = sum(e["elements"] for op, e in comms["by_op"].items() if op.startswith("reduce_scatter"))
        assert psi <= padded <= 1.02 * psi, (padded, psi)
        expected, psi = expected * padded / psi, padded
    if key[1] == 3:
        expected += (case["config"]["grad_accum"] - 1) * (expected - psi)  # every gather again; one reduce-scatter
    elif key[:2] == ("fsdp", 2):
        assert expected == 2 * psi  # gathered once in forward, kept to backward, reduce-scattered once
        expected += (case["config"]["grad_accum"] - 1) * psi  # FSDP2 frees after each backward: gathers again
    assert abs(comms["elements_per_step"] - expected) <= 0.01 * expected, (comms["elements_per_step"], comms["by_op"])


def test_offload_on_cpu_is_skipped_with_the_reason(run):
    result, cases = run
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    skipped = cases[("fsdp1", 3, 2, "fp32", "optimizer+params")]
    assert skipped["status"] == "skipped" and "offload runs on cuda" in skipped["skip_reason"]
    for name in ("fsdp1", "fsdp"):
        assert cases[(name, 2, 2, "fp32", "optimizer+params")]["skip_reason"].startswith("parameter offload needs")
    assert cases[("fsdp", 3, 2, "fp32", "optimizer+params")]["status"] == "ok"  # FSDP2 offloads on CPU too
