"""The mixture-of-experts preset (``moe-tiny``: one module per expert, hash routing) through DDP and the engines
that must train it as DDP does, with its two planted bugs (real CLI run, real gloo groups).

The preset's last expert takes token id 0 alone, so on some steps it gets no token on one rank (DDP averages
the other ranks' gradients with this rank's zeros) and on others on every rank (DDP leaves its gradient ``None``
and AdamW skips it: no weight decay, no moment update, its step count held). The first test shows both happen in
this run's data, after the expert has already learned (its moments are not zero, so a zero-gradient step would
move it); weight decay 0.1 makes even a never-used expert's zero-gradient step visible. Gradient accumulation (2
micro-batches) makes an expert used in one micro-batch and idle in the other a case of its own.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import zbench
from tests.plugins.wrong import MOE_BUGS
from tests.test_wrong_implementations import LEAST_MARGIN, margin_of
from zbench.cases.case import Case
from zbench.cases.model_source import model_info
from zbench.implementations.zero.flat import FlatLayout
from zbench.rank.training import step_batches

CORRECT = ["zero1", "zero2", "zero3", "torch_zero", "zero1-small-buckets", "zero2-small-buckets"]
#: Buckets of 0.05 MiB give the last expert's 64 x 256 weights a bucket of their own: on a rank where it idles, the
#: bucket is complete before backward starts, so it must still reduce in turn (grads.LaunchOrder; without it gloo
#: aborted both cases on a collective mismatch).
SMALL_BUCKETS = "{name: %s, options: {bucket_mb: 0.05}}"
WRONG = "tests.plugins.wrong:ZERO"
GRID = [(p, w) for p in ("fp32", "bf16") for w in (2, 3)]


def suite_yaml() -> str:
    bugs = [f'{{name: "{WRONG}", stages: [2], options: {{bug: {b}}}}}' for b in MOE_BUGS]
    small = [SMALL_BUCKETS % stage for stage in ("zero1", "zero2")]
    return f"""
name: moe
device: cpu
models: moe-tiny
world_sizes: [2, 3]
precisions: [fp32, bf16]
steps: 8
warmup_steps: 1
paired_rounds: 0
micro_batch: 2
grad_accum: 2
optimizer: {{weight_decay: 0.1}}
timeout_s: 300
implementations: [ddp, zero1, zero2, zero3, torch_zero, {", ".join(small + bugs)}]
"""


def label(case: dict) -> str:
    config = case["config"]
    options = config["options"]
    if options.get("bug"):
        return options["bug"]
    small = "-small-buckets" if options.get("bucket_mb") else ""
    return config["implementation"] + small + ("-twin" if config.get("noise_twin") else "")


def test_a_flat_shard_is_cut_at_its_parameters_edges():
    """The pieces the master store steps one by one: each parameter's part of a rank's shard (padding in none)."""
    params = [("a", torch.nn.Parameter(torch.zeros(5))), ("b", torch.nn.Parameter(torch.zeros(3)))]
    layout = FlatLayout.of([*params, ("c", torch.nn.Parameter(torch.zeros(2)))], world=3)  # 10 elements, shards of 4
    assert [layout.shard_segments(r) for r in range(3)] == [[(0, 0, 4)], [(0, 0, 1), (1, 1, 4)], [(2, 0, 2)]]


def test_an_expert_idle_on_a_rank_trains_under_zero3_as_under_ddp(tmp_path):
    """The fast tier's one mixture-of-experts run: stage 3 (gathers and reduce-scatters interleaved, where a
    bucket reduced out of turn was a collective mismatch), 2 micro-batches, against DDP's fixed fp32 bounds."""
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "models: moe-tiny\nimplementations: [ddp, zero3]\nworld_sizes: 2\nsteps: 6\nwarmup_steps: 1\n"
        "paired_rounds: 0\nmicro_batch: 2\ngrad_accum: 2\noptimizer: {weight_decay: 0.1}\nnoise_twin: false\n"
    )
    r = zbench("run", str(suite), "--results", str(tmp_path / "r"), "--report", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr[-3000:]
    (zero3,) = [json.loads(p.read_text()) for p in (tmp_path / "r").glob("*/cases/*zero3*.json")]
    assert zero3["status"] == "ok" and zero3["equivalence"]["equivalent"], zero3["equivalence"]


@pytest.mark.heavy
def test_plan_traces_the_experts_with_tokens_spread_evenly():
    """Routing shapes depend on the data, which fake tensors lack: the trace spreads the tokens evenly over the
    experts (none skipped, DDP without its search for unused parameters), and the traced states are the formulas."""
    r = zbench(
        "plan", "--model", "moe-tiny", "--gpus", "8", "--trace", "-i", "zero3", "-i", "ddp", "-o", "none", "--json"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for row in json.loads(r.stdout)["rows"]:
        traced, formula = row["trace"], row["formula"]
        assert traced["error"] is None, traced["error"]
        for category, where in formula.items():
            assert traced["state_bytes"][category]["device"] == pytest.approx(where["device"], rel=0.01), category


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    (tmp / "s.yaml").write_text(suite_yaml())
    run = zbench("run", str(tmp / "s.yaml"), "--results", str(tmp / "r"), "--report", str(tmp / "rep"), timeout=2400)
    cases = {}
    for path in (tmp / "r").glob("*/cases/*.json"):
        case = json.loads(path.read_text())
        cases[(label(case), case["config"]["precision"], case["config"]["world_size"])] = case
    return run, cases


@pytest.mark.heavy
@pytest.mark.parametrize("world", [2, 3])
def test_the_last_expert_is_idle_on_one_rank_and_on_every_rank_after_it_learned(matrix, world):
    _, cases = matrix
    case = Case.model_validate(cases[("ddp", "fp32", world)]["config"])
    info = model_info("moe-tiny")
    used = []  # per step: on how many ranks some micro-batch routes a token to the last expert (id 0)
    for step in range(case.steps):
        ranks = [step_batches(case, info, step, rank=r, world=world, device=torch.device("cpu")) for r in range(world)]
        used.append(sum(any(bool((idx == 0).any()) for idx, _ in batches) for batches in ranks))
    first = next(i for i, n in enumerate(used) if n)
    assert any(0 < n < world for n in used), used
    assert 0 in used[first + 1 :], used  # idle everywhere after its first gradient: AdamW must skip it


@pytest.mark.heavy
@pytest.mark.parametrize(("precision", "world"), GRID)
def test_the_sharded_engines_train_idle_experts_as_ddp_does(matrix, precision, world):
    _, cases = matrix
    wrong = {}
    for name in CORRECT:
        case = cases[(name, precision, world)]
        if case["status"] != "ok" or not case["equivalence"]["equivalent"]:
            wrong[name] = case.get("error") or case["equivalence"]["reason"]
    assert not wrong, f"judged NOT EQUIVALENT or failed at {precision} world {world}: {wrong}"


@pytest.mark.heavy
@pytest.mark.parametrize(("precision", "world"), GRID)
def test_both_idle_expert_bugs_are_caught(matrix, precision, world):
    run, cases = matrix
    assert run.returncode == 1  # the bugs fail the run
    weak = {}
    for bug in MOE_BUGS:
        case = cases[(bug, precision, world)]
        assert case["status"] == "ok", (bug, case.get("error"))
        failed = [c for c in case["equivalence"]["checks"] if c["passed"] is False]
        assert not case["equivalence"]["equivalent"] and failed, (bug, case["equivalence"]["checks"])
        if (margin := max(margin_of(c) for c in failed)) < LEAST_MARGIN:
            weak[bug] = margin
    assert not weak, f"caught by less than {LEAST_MARGIN}x their bound at {precision} world {world}: {weak}"
