"""``zbench compare A B``: a two-implementation suite built from flags, shown side by side."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table
from rich.text import Text

from zbench import suite as suite_mod
from zbench.console import Progress, fmt_bytes, fmt_ratio, fmt_seconds, status_text
from zbench.runner import RunResult, run_suite

JSON_FIELDS = ("case_id", "implementation", "status", "step_time_median_s", "step_time_iqr_s", "ratio_to_ddp",
               "tokens_per_s", "peak_memory_bytes", "model_state_bytes", "expected_model_state_bytes",
               "max_rel_loss_diff", "max_rel_param_diff", "equivalent", "error")


def case_summary(record: dict) -> dict:
    """The flat per-case figures scripts and CI consume."""
    summary = record.get("summary") or {}
    eq = record.get("equivalence") or {}
    state = record.get("model_state") or {}
    return {
        "case_id": record["case_id"], "implementation": record["config"]["implementation"],
        "status": record["status"], "step_time_median_s": summary.get("step_time_median_s"),
        "step_time_iqr_s": summary.get("step_time_iqr_s"), "ratio_to_ddp": record.get("ratio_to_ddp"),
        "tokens_per_s": summary.get("tokens_per_s"), "peak_memory_bytes": (record.get("memory") or {}).get("peak_bytes"),
        "model_state_bytes": state.get("measured_total"), "expected_model_state_bytes": state.get("expected_total"),
        "max_rel_loss_diff": eq.get("max_rel_loss_diff"), "max_rel_param_diff": eq.get("max_rel_param_diff"),
        "equivalent": eq.get("equivalent"), "error": record.get("error") or record.get("skip_reason"),
    }


@dataclass
class Comparison:
    result: RunResult

    @property
    def failed(self) -> bool:
        return bool(self.result.failed) or any(r["status"] == "skipped" for r in self.result.records)

    def as_json(self) -> dict:
        return {"run_id": self.result.run.run_id, "results": str(self.result.run.path),
                "cases": [case_summary(r) for r in self.result.records]}

    def table(self) -> Table:
        rows = [case_summary(r) for r in self.result.records]
        table = Table(title=f"zbench compare (run {self.result.run.run_id})")
        table.add_column("", no_wrap=True)
        for r in rows:
            table.add_column(r["implementation"], justify="right")
        lines = [
            ("status", lambda r, rec: status_text(rec)),
            ("median step time", lambda r, rec: fmt_seconds(r["step_time_median_s"])),
            ("IQR", lambda r, rec: fmt_seconds(r["step_time_iqr_s"])),
            ("ratio to DDP", lambda r, rec: fmt_ratio(r["ratio_to_ddp"])),
            ("tokens/s", lambda r, rec: f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"),
            ("peak memory / rank", lambda r, rec: fmt_bytes(r["peak_memory_bytes"])),
            ("model state / rank", lambda r, rec: fmt_bytes(r["model_state_bytes"])),
            ("  ZeRO formula", lambda r, rec: fmt_bytes(r["expected_model_state_bytes"])),
            ("max rel loss diff", lambda r, rec: "-" if r["max_rel_loss_diff"] is None else f"{r['max_rel_loss_diff']:.2e}"),
            ("param rel L2 diff", lambda r, rec: "-" if r["max_rel_param_diff"] is None else f"{r['max_rel_param_diff']:.2e}"),
            ("equivalent to DDP", lambda r, rec: {True: "yes", False: "NO", None: "-"}[r["equivalent"]]),
        ]
        for label, cell in lines:
            table.add_row(label, *(Text(cell(r, rec)) for r, rec in zip(rows, self.result.records)))
        return table


def run(a: str, b: str, *, device: str, nproc: int | None, model: str, steps: int, micro_batch: int,
        precision: str, results: Path, quiet: bool) -> Comparison:
    import torch

    resolved = suite_mod.resolve_device(device)
    if nproc is None:
        nproc = torch.cuda.device_count() if resolved == "cuda" else 2
    names = list(dict.fromkeys([a, b]))
    config = suite_mod.from_dict({
        "name": f"compare {' vs '.join(names)}", "device": device, "models": [model], "implementations": names,
        "world_sizes": [nproc], "precisions": [precision], "steps": steps, "micro_batch": micro_batch,
        "warmup_steps": min(3, steps - 1)}, source="compare")
    suite = suite_mod.build(config, path=None)
    return Comparison(run_suite(suite, results_root=results, progress=Progress(quiet=quiet)))
