"""``zbench.testing.assert_equivalent_to_ddp`` from pytest: passes for a correct implementation, fails loudly
otherwise, and honours every training setting (a weight-decay bug needs weight decay to show)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zbench.errors import UsageError
from zbench.testing import assert_equivalent_to_ddp

WRONG = "tests.plugins.wrong:MANUAL"


def test_correct_implementation_passes_with_every_check():
    record = assert_equivalent_to_ddp("torch_zero", steps=6, grad_accum=2, grad_clip=0.5, weight_decay=0.1)
    eq = record.equivalence
    assert eq is not None and eq.twin_case is not None
    assert {c.name: c.passed for c in eq.checks} == dict.fromkeys(
        ("loss", "grad_norm", "parameters", "ranks", "model_state"), True
    )


@pytest.mark.heavy
def test_weight_decay_bug_passes_without_weight_decay_and_fails_with_it():
    """The bug only exists when weight decay does: the API must pass the setting through to catch it."""
    assert_equivalent_to_ddp(WRONG, options={"bug": "wd_skips_norms"}, steps=6, weight_decay=0.0)
    with pytest.raises(AssertionError, match=r"not equivalent to DDP.*parameters.*\nchecks: .*parameters: FAIL"):
        assert_equivalent_to_ddp(WRONG, options={"bug": "wd_skips_norms"}, steps=6, weight_decay=0.1)


def test_bad_setting_is_one_clear_error():
    with pytest.raises(Exception, match="unknown key 'weight_decya'"):
        assert_equivalent_to_ddp("torch_zero", weight_decya=0.1)


CONFIG = Path(__file__).parent / "data" / "ds_zero3_offload.json"


@pytest.mark.heavy
def test_a_deepspeed_config_sets_what_it_says():
    """The documentation's stage-3 optimizer-offload config, on the reference engine: stage 3, bf16, offload,
    micro-batch 2 and clipping 1.0 all come from the file."""
    record = assert_equivalent_to_ddp("zero3", steps=4, deepspeed_config=CONFIG)
    config = record.config
    assert (config.stage, config.precision, config.offload, config.micro_batch, config.grad_clip) == (
        3,
        "bf16",
        "optimizer",
        2,
        1.0,
    )
    assert "zero_optimization.overlap_comm" in config.not_applied


@pytest.mark.parametrize("setting", [{"precision": "bf16"}, {"stage": 3}, {"lr": 0.01}])
def test_a_setting_given_twice_is_a_conflict(setting):
    with pytest.raises(UsageError, match=f"{next(iter(setting))} set by both the call and ds_zero3_offload.json"):
        assert_equivalent_to_ddp("zero3", deepspeed_config=CONFIG, **setting)
