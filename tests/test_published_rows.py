"""The published GPU rows the simulator is validated against (docs/data/published_rows_to_predict.yaml) stay
predictable: every row names a model, implementation and profile zbench has, and the stored validation
(docs/data/validate_published.json) reports every chosen row, none dropped, with its summary recomputable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.benchmarks.validate_published import ROWS, summarise
from zbench.cases import registry
from zbench.cases.model_source import model_info
from zbench.plan.simulate.cluster import load

DATA = Path(__file__).resolve().parents[1] / "docs" / "data"


def _rows() -> list[dict]:
    return yaml.safe_load(ROWS.read_text())["rows"]


def test_every_chosen_row_names_what_zbench_can_trace_and_simulate():
    rows = _rows()
    assert len({r["id"] for r in rows}) == len(rows) == 46
    assert {r["source"] for r in rows} == {"torchtitan", "fms-fsdp", "llm-foundry"}
    for row in rows:
        assert model_info(row["model"]).parameters > 0, row["id"]
        caps = registry.resolve(row["implementation"]).capabilities
        assert row["stage"] in caps.stages, row["id"]
        assert load(row["cluster"]).operators is not None, row["id"]
        assert row["published_tokens_per_s_per_gpu"] > 0 and len(row["commit"]) == 40, row["id"]


def test_the_stored_validation_reports_every_row_and_its_summary_holds():
    stored = json.loads((DATA / "validate_published.json").read_text())
    assert [r["id"] for r in stored["rows"]] == [r["id"] for r in _rows()]
    for model in ("operators", "peak_x_efficiency"):
        assert stored["summary"][model] == summarise(stored["rows"], model)
        for row in stored["rows"]:
            predicted = row[model]
            assert predicted["error"] == pytest.approx(
                predicted["predicted_tokens_per_s_per_gpu"] / row["published_tokens_per_s_per_gpu"] - 1, abs=1e-3
            )


def test_a_row_that_failed_to_trace_is_listed_not_dropped():
    ok = {"id": "a", "source": "s", "cluster": "c", "published_checkpointing": "none",
          "operators": {"error": 0.2}, "peak_x_efficiency": {"error": -0.1}}  # fmt: skip
    failed = ok | {"id": "b", "operators": {"trace_error": "boom"}}
    summary = summarise([ok, failed], "operators")
    assert summary["failed"] == ["b"] and summary["all"]["rows"] == 1 and summary["all"]["worst_abs"] == 0.2
