"""``zbench tune --verify``: the chosen setups run for real on a profile calibrated here, the predicted order held
against the measured one (with planted orders it must read right), the emitted suite run as any suite, and the
emitted DeepSpeed config parsed by DeepSpeed itself at the world size it was written for."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

QUESTION = ("tune", "--model", "tiny", "--gpus", "2", "--precision", "fp32", "-i", "ddp", "-i", "zero2", "-i", "zero3",
            "-o", "none", "--micro-batch", "1", "--micro-batch", "2", "--checkpointing", "off")  # fmt: skip


@pytest.fixture(scope="module")
def profile(cli, tmp_path_factory):
    """This machine, calibrated (quick probes)."""
    out = tmp_path_factory.mktemp("calibrated")
    r = cli("calibrate", "--quick", "--nvme-dir", str(out), "--out", str(out / "here.yaml"))
    assert r.returncode == 0, r.stderr
    return out / "here.yaml"


@pytest.fixture(scope="module")
def verified(cli, profile, tmp_path_factory):
    """The top 3 setups verified: short runs, few paired rounds."""
    out = tmp_path_factory.mktemp("verified")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZBENCH_CACHE_DIR", str(out / "cache"))
        r = cli(*QUESTION, "--cluster", str(profile), "--verify", "3", "--verify-steps", "5", "--paired-rounds", "3",
                "--results", str(out / "results"), "--report", str(out / "report"),
                "--emit-suite", str(out / "chosen.yaml"), "--top", "3")  # fmt: skip
    return r, out


def test_verify_runs_the_top_setups_and_reports_predicted_against_measured(verified):
    r, out = verified
    assert r.returncode == 0, r.stdout + r.stderr
    assert "predicted against measured" in r.stdout and "Kendall tau" in r.stdout
    (run,) = (out / "results").iterdir()
    stored = json.loads((run / "tune.json").read_text())
    rows = stored["verification"]["rows"]
    assert [row["rank"] for row in rows] == [1, 2, 3]
    assert all(row["status"] == "ok" and row["equivalent"] and row["measured_tokens_per_s_per_gpu"] for row in rows)
    best = max(rows, key=lambda row: row["measured_tokens_per_s_per_gpu"])
    assert stored["verification"]["measured_best_rank"] == best["rank"]
    searched = stored["search"]["ranked"]
    assert len([s for s in searched if not s["options"]]) == 6  # ddp, zero2, zero3 at micro-batch 1 and 2...
    assert any("options:" in line for line in stored["search"]["options_searched"])  # ...and the kept variants
    assert all(set(s["options"]) <= {"bucket_mb", "prefetch"} for s in searched)  # only declared options vary
    page = (out / "report" / "tune.html").read_text()
    assert "Predicted against measured" in page and rows[0]["name"] in page and "Pruned, and why" in page
    assert "Options searched" in page and "zero3: option prefetch" in page
    assert 'href="tune.html"' in (out / "report" / "index.html").read_text()
    assert "its own steps" in page and all(row["steady_tokens_per_s_per_gpu"] for row in rows)


def test_the_tune_page_says_where_a_setup_level_with_the_best_was_predicted_in_the_top_two(verified):
    """The measured best predicted #3 but level with #1 is not marked a miss; with nothing level, it is."""
    from zbench.report import render
    from zbench.results.store import RunDir

    _, out = verified
    (path,) = (out / "results").iterdir()
    stored = json.loads((path / "tune.json").read_text())
    for level, says in (([1], "a setup level with it in the predicted top two"), ([], "not in the predicted top two")):
        v = stored["verification"] | {"measured_best_rank": 3, "level_with_best": level, "best_in_top_two": False,
                                      "a_best_in_top_two": bool(level)}  # fmt: skip
        (path / "tune.json").write_text(json.dumps(stored | {"verification": v}))
        report = out / f"report-level-{len(level)}"
        render(RunDir(path.parent, path.name), report, results_root=path.parent)
        order = (report / "tune.html").read_text().split('id="order">')[1].split("</dd>")[0]
        assert says in order and ("not in" in order) == (not level)
    (path / "tune.json").write_text(json.dumps(stored))


def test_the_order_is_read_right_from_planted_predictions_and_an_oom_is_a_tune_error(verified):
    """The verdict's arithmetic on the real run's records: predictions planted in the measured order give tau 1
    and the best at #1; reversed, tau -1 and the best last; a chosen setup whose record says it ran out of memory
    is a tune error with no measured rate."""
    from zbench.results.store import RunDir
    from zbench.run.runner import RunResult
    from zbench.tune.search import Candidate
    from zbench.tune.verify import compare, measured_rate

    _, out = verified
    (path,) = (out / "results").iterdir()
    run = RunDir(path.parent, path.name)
    records = [r for r in run.cases() if not r.config.noise_twin]
    by_id = {r.case_id: r for r in records}
    for r in records:  # the measured rate: the DDP reference's over the paired ratio (the reference: its own)
        reference = by_id[r.equivalence.reference_case]
        expected = r.summary.tokens_per_s_per_rank if reference is r else (
            reference.summary.tokens_per_s_per_rank / r.paired.median_ratio)  # fmt: skip
        assert measured_rate(r, records) == pytest.approx(expected)
    measured = sorted(records, key=lambda r: measured_rate(r, records) or 0.0, reverse=True)

    def chosen(order):
        return [
            Candidate(r.config, estimate=SimpleNamespace(tokens_per_s_per_gpu=float(100 - i)),
                      needs=SimpleNamespace(gpu=1.0))
            for i, r in enumerate(order)
        ]  # fmt: skip

    right = compare(chosen(measured), RunResult(run, records))
    assert right.kendall_tau == pytest.approx(1.0) and right.measured_best_rank == 1
    assert "within 2.0% of each other" in right.notes[0]  # 100, 99, 98: inside the model's error, and said so
    wide = [Candidate(c.case, estimate=SimpleNamespace(tokens_per_s_per_gpu=100.0 / (i + 1)), needs=c.needs)
            for i, c in enumerate(chosen(measured))]  # fmt: skip
    told = compare(wide, RunResult(run, records)).notes  # 100, 50, 33: an order the model can tell, so no note
    assert not [n for n in told if "pairs of setups apart" not in n and "speed changed" not in n]  # but on the rounds
    assert any("pairs of setups apart" in n for n in right.notes)  # and how much of the order the rounds resolve
    wrong = compare(chosen(measured[::-1]), RunResult(run, records))
    assert wrong.kendall_tau == pytest.approx(-1.0) and wrong.measured_best_rank == len(measured)
    level = [Candidate(r.config, estimate=SimpleNamespace(tokens_per_s_per_gpu=1.0), needs=SimpleNamespace(gpu=1.0))
             for r in measured]  # fmt: skip
    tied = compare(level, RunResult(run, records))
    assert tied.kendall_tau is None and "all equal" in tied.notes[0]  # not NaN: the JSON stays JSON
    oom = [r.model_copy(update={"status": "oom"}) if r is measured[0] else r for r in records]
    with_oom = compare(chosen(measured), RunResult(run, oom))
    first = with_oom.rows[0]
    assert first.tune_error == "predicted to fit, ran out of memory" and first.measured_tokens_per_s_per_gpu is None
    assert with_oom.notes and with_oom.measured_best_rank == 2


def test_verify_refuses_a_profile_calibrated_on_another_machine(cli, profile, tmp_path):
    data = yaml.safe_load(profile.read_text())
    data["calibration"]["host"] = "elsewhere"
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(data))
    r = cli(*QUESTION, "--cluster", str(other), "--verify", "1")
    assert r.returncode == 2
    assert "was calibrated on elsewhere (cpu), not on this machine" in r.stderr.strip().splitlines()[-1]


def test_the_emitted_suite_runs(verified, cli, tmp_path):
    _, out = verified
    short = ("--set", "steps=4", "--set", "warmup_steps=1", "--set", "paired_rounds=0")
    r = cli("run", str(out / "chosen.yaml"), *short, "--results", str(tmp_path / "r"), "--report", str(tmp_path / "p"))
    assert r.returncode == 0, r.stdout + r.stderr


def _parse_on_rank(rank: int, path: str, port: int) -> None:
    """One rank of a 2-rank group: DeepSpeed's communication set up as its launcher would, then its config parser
    (which reads the world size from that group)."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", DS_ACCELERATOR="cpu")  # fmt: skip
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    config = DeepSpeedConfig(path)
    assert config.world_size == 2
    assert config.train_batch_size == config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps * 2


def test_deepspeed_accepts_the_emitted_config_at_the_world_it_was_written_for(cli, tmp_path, monkeypatch):
    """DeepSpeed's own config parser, in a 2-rank gloo group, takes the file (its batch-size check included)."""
    pytest.importorskip("deepspeed")
    import torch.multiprocessing as mp

    from zbench.ports import free_port

    monkeypatch.setenv("ZBENCH_CACHE_DIR", str(tmp_path / "cache"))
    r = cli("tune", "--model", "tiny", "--gpus", "2", "--cluster", "cpu-2core", "--precision", "bf16", "-i", "zero2",
            "-i", "deepspeed", "--micro-batch", "2", "--global-batch", "256", "--checkpointing", "off",
            "--emit-deepspeed", str(tmp_path / "ds.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    written = json.loads((tmp_path / "ds.json").read_text())
    assert written["gradient_accumulation_steps"] == 2 and written["bf16"]["enabled"]  # 256 = 2 x 32 x 2 x 2
    mp.spawn(_parse_on_rank, args=(str(tmp_path / "ds.json"), free_port()), nprocs=2)
