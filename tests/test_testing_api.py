"""``zbench.testing.assert_equivalent_to_ddp`` from pytest: passes for a correct implementation, fails loudly
otherwise."""

from __future__ import annotations

import pytest

from zbench.testing import assert_equivalent_to_ddp


def test_correct_implementation_passes():
    record = assert_equivalent_to_ddp("torch_zero", steps=6)
    assert record.equivalence is not None and record.equivalence.max_rel_loss_diff <= 1e-5


def test_wrong_implementation_fails_with_figures():
    with pytest.raises(AssertionError, match=r"not equivalent to DDP.*param rel L2 diff"):
        assert_equivalent_to_ddp("tests.plugins.faulty:FAULTY", options={"fault": "unsynced"}, steps=6)
