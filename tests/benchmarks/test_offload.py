"""Benchmark: what each offload mode costs in step time and buys in resident memory (suites/offload.yaml).

Not part of the default test run (about five minutes on 2 cores). Run:
    python -m pytest tests/benchmarks/test_offload.py -m benchmark --benchmark-enable -s

Runs the shipped CPU offload suite through the CLI (the 41M-parameter GPT, world 2,
NVMe swap files in a temporary directory) and prints, per stage, each mode's median
step time relative to the same stage without offload and each rank's peak resident
memory during training. One bar is checked, because it is the point of NVMe offload:
moving the optimizer state and master weights to disk must lower every rank's peak
RSS, against the same stage with them in host memory, by at least 80% of the bytes moved.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import ROOT, zbench

BAR = 0.8


@pytest.mark.benchmark
def test_offload_cost_and_memory(benchmark, tmp_path):
    config = yaml.safe_load((ROOT / "suites" / "offload.yaml").read_text())
    (tmp_path / "nvme").mkdir()
    config["nvme_dir"] = str(tmp_path / "nvme")
    (tmp_path / "offload.yaml").write_text(yaml.safe_dump(config))
    result = benchmark.pedantic(
        zbench,
        args=(
            "run",
            str(tmp_path / "offload.yaml"),
            "--results",
            str(tmp_path / "results"),
            "--report",
            str(tmp_path / "report"),
        ),
        rounds=1,
        iterations=1,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = list((tmp_path / "results").iterdir())
    records = {
        (r["config"]["implementation"], r["config"]["offload"]): r
        for r in (json.loads(p.read_text()) for p in (run_dir / "cases").glob("*.json"))
        if r["status"] == "ok"
    }
    lines, ratios = [], {}
    for (impl, mode), r in sorted(records.items()):
        base = records.get((impl, "none"))
        ratio = r["summary"]["step_time_median_s"] / base["summary"]["step_time_median_s"] if base else None
        ratios[f"{impl}/{mode}"] = ratio
        rss = ", ".join(f"{m['bytes'] / 2**20:.0f}" for m in r["memory"]["per_rank"])
        vs_none = f"x{ratio:.2f} vs none" if ratio else ""
        lines.append(
            f"{impl:>6} {mode:<17} step {r['summary']['step_time_median_s'] * 1e3:7.1f} ms {vs_none:>14}"
            f"  peak RSS per rank {rss} MiB"
        )
    savings = {}
    for impl in ("zero1", "zero2", "zero3"):
        host, disk = records[(impl, "optimizer")], records[(impl, "nvme")]
        moved = sum(locs["disk"] for locs in disk["model_state"]["measured"].values())
        savings[impl] = [
            (h["bytes"] - d["bytes"]) / moved for h, d in zip(host["memory"]["per_rank"], disk["memory"]["per_rank"])
        ]
        lines.append(
            f"{impl} nvme vs optimizer: {moved / 2**20:.0f} MiB moved to disk per rank, peak RSS lower by "
            + ", ".join(f"{s:.2f}" for s in savings[impl])
            + " of it"
        )
    benchmark.extra_info.update({"step_time_vs_none": ratios, "rss_saved_over_moved": savings})
    print("\n" + "\n".join(lines))
    for impl, per_rank in savings.items():
        assert min(per_rank) >= BAR, (impl, per_rank)
