"""DeepSpeed's declared layout (implementations/deepspeed_layout.py) against figures worked by hand, and the
byte counter that measures it. Needs no DeepSpeed install; the layout is held to DeepSpeed's real bytes in
tests/test_deepspeed.py."""

from __future__ import annotations

import pytest
import torch

from zbench.implementations.deepspeed_layout import deepspeed_layout, persistent_elements, widest_partition_overlap
from zbench.state_bytes import tensor_bytes

SIZES = [16384, 50, 150_000, 100]  # an embedding, a bias, a weight above the persistence threshold, a norm
PSI = sum(SIZES)  # 166,534
BF16 = {"data_types": {"grad_accum_dtype": "fp32"}}


def layout(stage: int, precision: str, offload: str = "none", config: dict | None = None, grad_accum: int = 1) -> dict:
    out = deepspeed_layout(
        sizes=SIZES,
        world=2,
        stage=stage,
        precision=precision,
        offload=offload,
        optimizer_bytes=8,
        grad_accum=grad_accum,
        config=config or {},
    )
    held = {cat: {loc: b for loc, b in locs.items() if b} for cat, locs in out.items()}
    return {cat: locs for cat, locs in held.items() if locs}


def test_stage_3_keeps_small_parameters_whole_next_to_every_shard():
    shard = 8192 + 25 + 75_000 + 50  # each parameter split in two, rounded up
    assert layout(3, "bf16", config=BF16) == {
        "parameters": {"device": 2 * shard + 2 * (16384 + 50 + 100)},
        "gradients": {"device": 4 * shard},
        "optimizer_state": {"device": 8 * shard},
        "master_weights": {"device": 4 * shard},
    }
    assert layout(3, "fp32", "optimizer+params") == {
        "parameters": {"host": 4 * shard, "device": 4 * (16384 + 50 + 100)},
        "gradients": {"host": 8 * shard},  # the flat partition and the master's gradient
        "optimizer_state": {"host": 8 * shard},
        "master_weights": {"host": 4 * shard},
    }


def test_the_persistence_thresholds_come_from_the_config():
    assert persistent_elements(SIZES, 2, {}) == 16384 + 50 + 100
    assert persistent_elements(SIZES, 2, {"stage3_param_persistence_threshold": 0}) == 0
    # the model-wide budget is split between ranks and filled in parameter order
    assert persistent_elements(SIZES, 2, {"stage3_model_persistence_threshold": 20_000}) == 50 + 100


def test_stages_1_and_2_free_their_gradients_except_bf16_optimizer():
    half = PSI // 2
    assert layout(2, "fp32") == {
        "parameters": {"device": 4 * PSI},
        "optimizer_state": {"device": 8 * half},
        "master_weights": {"device": 4 * half},  # a separate fp32 partition even in fp32
    }
    assert layout(1, "bf16", config=BF16)["gradients"] == {"device": 4 * PSI}  # BF16_Optimizer keeps them whole
    assert "gradients" not in layout(1, "bf16", config={"data_types": {"grad_accum_dtype": "bf16"}})
    assert "gradients" not in layout(2, "bf16", config=BF16)


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_offload_stages_the_partition_and_the_largest_gradient(stage):
    half = PSI // 2
    assert layout(stage, "bf16", "optimizer", BF16) == {
        "parameters": {"device": 2 * PSI, "host": 2 * half},
        "gradients": {"host": 4 * half + 2 * 150_000, "device": 2 * 150_000},
        "optimizer_state": {"host": 8 * half},
        "master_weights": {"host": 4 * half},
    }


def test_fp32_stage_2_offload_accumulates_each_overlapping_parameter_whole_on_the_host():
    """Partitions of 83,267 elements: rank 0 overlaps the embedding, the bias and the big weight (166,434
    elements), rank 1 the big weight and the norm (150,100); the fullest rank counts."""
    assert widest_partition_overlap(SIZES, 2) == 16384 + 50 + 150_000
    accumulating = layout(2, "fp32", "optimizer", grad_accum=2)["gradients"]["host"]
    assert accumulating - layout(2, "fp32", "optimizer")["gradients"]["host"] == 4 * (16384 + 50 + 150_000)
    # bf16 accumulates into a compact fp32 partition instead, and stage 1 reduces only at the boundary
    assert layout(2, "bf16", "optimizer", BF16, grad_accum=2) == layout(2, "bf16", "optimizer", BF16)
    assert layout(1, "fp32", "optimizer", grad_accum=2) == layout(1, "fp32", "optimizer")


def test_a_meta_tensor_holds_no_memory():
    """DeepSpeed keeps meta stand-ins of its parameters; counting them overstated its gradients by 4 bytes a
    parameter."""
    real = torch.zeros(1000)
    stand_in = torch.zeros(1000, device="meta")
    assert tensor_bytes([real, stand_in], compute_device=torch.device("cpu"))["device"] == 4000


def test_a_presets_parameter_shapes_are_its_modules():
    """The layouts and DeepSpeed's declared traffic read parameter shapes and sizes off the preset; they must be the
    module's."""
    from zbench.cases.models import GPT
    from zbench.presets import PRESETS

    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            model = GPT(cfg)
        distinct = {id(p): p for p in model.parameters()}
        assert cfg.parameter_shapes == tuple(tuple(p.shape) for p in distinct.values()), name
        assert cfg.parameter_sizes == tuple(p.numel() for p in distinct.values()), name
        assert sum(cfg.parameter_sizes) == cfg.num_parameters, name


def test_the_cases_precision_wins_over_a_config_written_for_bf16():
    """A bf16 case's fp32 probe trains from the same DeepSpeed config: its ``bf16`` section must not make it bf16."""
    from zbench.implementations.deepspeed_zero import deepspeed_config
    from zbench.protocol import TrainSpec

    user = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    bf16 = deepspeed_config(
        TrainSpec(device=torch.device("cpu"), precision="bf16", stage=3, options={"config": user}), 2
    )
    fp32 = deepspeed_config(
        TrainSpec(device=torch.device("cpu"), precision="fp32", stage=3, options={"config": user}), 2
    )
    assert bf16["bf16"] == {"enabled": True} and "bf16" not in fp32
    assert fp32["zero_optimization"]["stage"] == 3


def test_the_bucket_size_option_sets_both_of_deepspeeds_buckets_and_bad_values_are_refused():
    """``bucket_size`` (what ``zbench tune`` searches) is DeepSpeed's reduce and all-gather bucket, in elements; a
    config's own buckets stand when the option is not given, and one line refuses a bad value or a contradiction."""
    from zbench.implementations.deepspeed_zero import BUCKET_ELEMENTS, checked_options, deepspeed_config
    from zbench.protocol import TrainSpec

    def zero(options: dict) -> dict:
        checked_options(options)
        spec = TrainSpec(device=torch.device("cpu"), precision="fp32", stage=2, options=options)
        return deepspeed_config(spec, 1)["zero_optimization"]

    buckets = ("reduce_bucket_size", "allgather_bucket_size")
    assert [zero({})[k] for k in buckets] == [BUCKET_ELEMENTS] * 2
    assert [zero({"bucket_size": 5_000_000})[k] for k in buckets] == [5_000_000] * 2
    own = {"config": {"zero_optimization": {"reduce_bucket_size": 200_000_000}}}
    assert [zero(own)[k] for k in buckets] == [200_000_000, BUCKET_ELEMENTS]
    agreeing = {**own, "bucket_size": 200_000_000}
    assert [zero(agreeing)[k] for k in buckets] == [200_000_000] * 2
    for bad, message in [
        ({"bucket_size": 0}, "bucket_size must be a whole number"),
        ({"bucket_size": 2.5}, "bucket_size must be a whole number"),
        ({"bucket_size": True}, "bucket_size must be a whole number"),
        ({**own, "bucket_size": 5_000_000}, "reduce_bucket_size 200000000 disagree: set one"),
        ({"bucket_mb": 16}, "deepspeed takes the options config"),
    ]:
        with pytest.raises(ValueError, match=message):
            checked_options(bad)


def test_overlap_and_prefetch_options_set_deepspeeds_keys_and_bad_values_are_refused():
    """``overlap_comm`` and ``prefetch_size`` (what ``zbench tune`` searches at stages 1-2 and 3) are DeepSpeed's
    ``overlap_comm`` and ``stage3_prefetch_bucket_size``; without them DeepSpeed's own defaults stand (nothing is
    written), a config's own value stands, and one line refuses a bad value or a contradiction."""
    from zbench.implementations.deepspeed_zero import checked_options, deepspeed_config
    from zbench.protocol import TrainSpec

    def zero(options: dict, stage: int = 3) -> dict:
        checked_options(options)
        spec = TrainSpec(device=torch.device("cpu"), precision="fp32", stage=stage, options=options)
        return deepspeed_config(spec, 1)["zero_optimization"]

    assert "overlap_comm" not in zero({}) and "stage3_prefetch_bucket_size" not in zero({})
    assert zero({"overlap_comm": True}, stage=2)["overlap_comm"] is True
    assert zero({"prefetch_size": 0})["stage3_prefetch_bucket_size"] == 0
    own = {"config": {"zero_optimization": {"overlap_comm": False, "stage3_prefetch_bucket_size": 1000}}}
    assert (zero(own)["overlap_comm"], zero(own)["stage3_prefetch_bucket_size"]) == (False, 1000)
    assert zero({**own, "prefetch_size": 1000})["stage3_prefetch_bucket_size"] == 1000
    for bad, message in [
        ({"prefetch_size": -1}, "prefetch_size must be a whole number of elements >= 0"),
        ({"prefetch_size": 1.5}, "prefetch_size must be a whole number"),
        ({"prefetch_size": False}, "prefetch_size must be a whole number"),
        ({"overlap_comm": 1}, "overlap_comm must be true or false, got 1"),
        ({"overlap_comm": "yes"}, "overlap_comm must be true or false"),
        ({**own, "overlap_comm": True}, "overlap_comm True and the config's overlap_comm False disagree"),
        ({**own, "prefetch_size": 0}, "stage3_prefetch_bucket_size 1000 disagree: set one"),
    ]:
        with pytest.raises(ValueError, match=message):
            checked_options(bad)
