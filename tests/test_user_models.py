"""A model the user brings (``models: [module:builder]``) through every built-in implementation (real CLI run).

The model (``tests.plugins.user_models:shared_blocks``) ties its head to its embedding and shares one
weight between two blocks; with and without activation checkpointing, every implementation must train it
like DDP (bad builders are in tests/test_bad_input.py).
"""

from __future__ import annotations

import pytest

from tests.conftest import zbench
from zbench.results.record import CaseRecord
from zbench.results.store import RunDir

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

BUILDER = "tests.plugins.user_models:shared_blocks"
SUITE = f"""
name: user-model
device: cpu
models: ["{BUILDER}"]
implementations: [ddp, fsdp, torch_zero, zero1, zero2, zero3]
activation_checkpointing: [false, true]
world_sizes: 2
steps: 6
warmup_steps: 1
paired_rounds: 0
"""


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[CaseRecord]:
    tmp = tmp_path_factory.mktemp("user-model")
    (tmp / "suite.yaml").write_text(SUITE)
    r = zbench("run", str(tmp / "suite.yaml"), "--results", str(tmp / "results"), "--report", str(tmp / "report"))
    assert r.returncode == 0, r.stderr[-4000:]
    (run,) = (tmp / "results").iterdir()
    return list(RunDir(run.parent, run.name).cases())


def test_every_implementation_trains_the_shared_weight_model_like_ddp(records):
    judged = [r for r in records if not r.config.is_reference and not r.config.noise_twin]
    assert len(judged) == 2 * 6  # FSDP2 at stages 2 and 3, torch ZeRO, ZeRO-1-3; with and without checkpointing
    verdicts = {
        r.case_id: (r.status, r.equivalent, r.equivalence.failed_checks if r.equivalence else None) for r in judged
    }
    assert all(v == ("ok", True, []) for v in verdicts.values()), verdicts
    # each implementation's declared traffic, for this model's root and blocks (the shared weight counted once)
    traffic = {r.case_id: r.comms.error_rel for r in judged if r.comms}
    assert len(traffic) == len(judged) and all(abs(e) <= 0.05 for e in traffic.values()), traffic
    assert sum(r.config.activation_checkpointing for r in judged) == 6


def test_the_user_model_is_measured_not_guessed(records):
    from tests.plugins.user_models import SharedBlocksLM

    model = SharedBlocksLM()
    unique = {id(p): p for p in model.parameters()}
    parameters = sum(p.numel() for p in unique.values())
    ddp = next(r for r in records if r.config.is_reference and not r.config.activation_checkpointing)
    assert ddp.model_parameters == parameters
    assert ddp.config.seq_len == model.max_seq_len  # the suite's seq_len defaults to the model's
    assert ddp.throughput is not None and ddp.throughput.model_flops_per_token == 6 * parameters
    assert ddp.case_id.startswith("tests.plugins.user_models_shared_blocks-ddp-")
