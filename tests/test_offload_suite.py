"""Offload through the harness: one real suite run (CPU, gloo, world 2) over every offload mode.

Checks what only the harness can: unsupported stage x mode combinations are
skipped with their reason, each case's NVMe sub-directory exists only while it
runs, the model state is accounted by location next to the formulas'
placement, and every offloaded case still trains like DDP.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import zbench

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

SUITE = """
name: offload-check
description: every offload mode, tiny model
device: cpu
models: tiny
world_sizes: 2
steps: 20
warmup_steps: 2
paired_rounds: 0
timeout_s: 120
implementations: [ddp, fsdp, zero1, zero2, zero3]
offload: [optimizer, optimizer+params, nvme]
nvme_dir: {nvme}
"""

#: (implementation, offload) -> why it is skipped (a fragment of the reason)
SKIPPED = {
    ("zero1", "optimizer+params"): "parameter offload needs stage 3",
    ("zero2", "optimizer+params"): "parameter offload needs stage 3",
    ("fsdp", "optimizer"): "not supported",
    ("fsdp", "nvme"): "not supported",
}


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    nvme = tmp / "nvme"
    nvme.mkdir()
    (tmp / "suite.yaml").write_text(SUITE.format(nvme=nvme))
    result = zbench("run", str(tmp / "suite.yaml"), "--results", str(tmp / "results"), "--report", str(tmp / "report"))
    (run_dir,) = list((tmp / "results").iterdir())
    records = {
        (c["config"]["implementation"], c["config"]["offload"]): c
        for c in (json.loads(p.read_text()) for p in (run_dir / "cases").glob("*.json"))
    }
    return result, records, nvme, tmp


def test_suite_passes(offload_run):
    result, _, _, _ = offload_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_unsupported_combinations_are_skipped_with_their_reason(offload_run):
    _, records, _, _ = offload_run
    for key, reason in SKIPPED.items():
        assert records[key]["status"] == "skipped", key
        assert reason in records[key]["skip_reason"], (key, records[key]["skip_reason"])


def test_every_supported_mode_trains_like_ddp(offload_run):
    _, records, _, _ = offload_run
    ran = {k: r for k, r in records.items() if r["status"] != "skipped" and k[0] != "ddp"}
    assert set(ran) == {
        ("fsdp", "optimizer+params"),
        ("zero1", "optimizer"),
        ("zero1", "nvme"),
        ("zero2", "optimizer"),
        ("zero2", "nvme"),
        ("zero3", "optimizer"),
        ("zero3", "optimizer+params"),
        ("zero3", "nvme"),
    }
    for key, r in ran.items():
        assert r["status"] == "ok", (key, r.get("error"), r.get("stderr_tail", "")[-2000:])
        eq = r["equivalence"]
        assert eq["equivalent"] and eq["max_rel_loss_diff"] <= 1e-5 and eq["max_rel_param_diff"] <= 1e-5, (key, eq)


def test_state_is_accounted_by_location_next_to_the_formulas(offload_run):
    """Measured within 2% of the placement at every location (tiny pads each flat group to the world size)."""
    _, records, _, _ = offload_run
    for key, r in records.items():
        if r["status"] != "ok" or key[0] == "ddp":
            continue
        for loc, v in r["model_state"]["by_location"].items():
            assert v["measured"] == pytest.approx(v["predicted"], rel=0.02, abs=4096), (key, loc, v)
    nvme = records[("zero3", "nvme")]["model_state"]["measured"]
    assert nvme["optimizer_state"]["disk"] > 0 and nvme["master_weights"]["disk"] > 0
    assert nvme["parameters"]["disk"] > 0 and nvme["optimizer_state"]["host"] == 0
    offloaded = records[("zero2", "optimizer")]["model_state"]["measured"]
    assert offloaded["optimizer_state"]["device"] == 0 and offloaded["optimizer_state"]["host"] > 0


def test_nvme_files_are_removed_when_each_case_ends(offload_run):
    _, _, nvme, _ = offload_run
    assert list(nvme.iterdir()) == []


def test_report_shows_predicted_next_to_measured_by_location(offload_run):
    _, _, _, tmp = offload_run
    pages = [p.read_text() for p in (Path(tmp) / "report" / "cases").glob("*zero3*nvme*.html")]
    assert pages, "no case page for the NVMe case"
    assert "by category and location (measured / predicted: ZeRO formulas)" in pages[0]
    assert "total (error)" in pages[0]
