"""``zbench tune``: the search traced from the real code, its cache, the memory pruning (planted limits just above
and just below traced needs) and its one-line refusals."""

from __future__ import annotations

import json
import os

import pytest

from zbench.tune.space import Question, grad_accum_for, search_space

BASE = ("tune", "--model", "tiny", "--gpus", "2", "--cluster", "cpu-2core", "-i", "ddp", "-i", "zero3",
        "--micro-batch", "1", "--micro-batch", "2", "--checkpointing", "off", "--no-search-options")  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trace-cache")


@pytest.fixture
def tune(cli, cache_dir, monkeypatch):
    monkeypatch.setenv("ZBENCH_CACHE_DIR", str(cache_dir))

    def run(*extra: str):
        return cli(*BASE, *extra)

    return run


@pytest.fixture(scope="module")
def answer(cli, cache_dir):
    """The search once, cold: ddp and zero3 (every offload mode), micro-batch 1 and 2, as JSON."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
        r = cli(*BASE, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_tune_traces_every_setup_and_ranks_them_fastest_first(answer):
    ranked = answer["ranked"]
    # ddp: 1 setup; zero3: none, optimizer, optimizer+params; each at micro-batch 1 and 2. NVMe: below
    assert len(ranked) == 8
    assert {(r["implementation"], r["offload"]) for r in ranked} == {
        ("ddp", "none"), ("zero3", "none"), ("zero3", "optimizer"), ("zero3", "optimizer+params")
    }  # fmt: skip
    assert [(s["offload"], s["micro_batch"], s["needs"]) for s in answer["pruned"]] == [("nvme", 1, None),
                                                                                        ("nvme", 2, None)]  # fmt: skip
    rates = [r["estimate"]["tokens_per_s_per_gpu"] for r in ranked]
    assert rates == sorted(rates, reverse=True) and rates[-1] > 0
    assert not any(r["cached"] for r in ranked)
    assert all(r["needs"]["gpu"] > 0 for r in ranked)
    # offloading the optimizer takes its state off the GPU: the need read from the trace says so (on the CPU
    # stand-in the host-held state shares the traced peak and must be taken off it)
    need = {(r["offload"], r["micro_batch"]): r["needs"] for r in ranked if r["implementation"] == "zero3"}
    for mb in (1, 2):
        assert need[("optimizer", mb)]["gpu"] < need[("none", mb)]["gpu"]
        assert need[("optimizer", mb)]["host_per_node"] > need[("none", mb)]["host_per_node"] == 0
    assert "measured error" in answer["measured_error"]
    assert not any("deepspeed" in line for line in answer["left_out"])  # not asked for: not listed


def test_nvme_is_traced_only_where_its_host_twin_does_not_fit(tune, answer):
    """ZeRO-Infinity's disk tier holds what CPU offload holds on the host (at stage 3, ``optimizer+params``) and
    needs no less of the GPU: where that twin fits, the NVMe setup is pruned untraced, naming it. Where host memory
    cannot hold the twin, the NVMe setup is traced and ranked; planted: a host limit between the two. At `tiny`
    the step's three buffered sub-groups (at least 1 MiB each by default, ``NvmeMasters.FLOOR``) outweigh the state
    they stream, so the disk tier saves host memory only in sub-groups of 1/16 MiB, as in a model of billions it
    does in 64 MiB ones."""
    twins = {s["micro_batch"]: s for s in answer["ranked"] if s["offload"] == "optimizer+params"}
    for s in answer["pruned"]:
        assert s["pruned"] == (f"not traced: its host twin ({twins[s['micro_batch']]['name']}) fits, needs no more "
                               "GPU and offloads faster")  # fmt: skip
    small_sub_groups = ("--option", "nvme_chunk_mb=0.0625")
    r = tune("--json", "-o", "nvme", *small_sub_groups)  # no twin asked for: traced
    assert r.returncode == 0, r.stderr
    disk = {s["micro_batch"]: s for s in json.loads(r.stdout)["ranked"]}
    assert all(disk[mb]["needs"]["gpu"] >= twins[mb]["needs"]["gpu"] for mb in (1, 2))
    hosted = [s for s in answer["ranked"] if s["needs"]["host_per_node"] > 0]
    between = (max(d["needs"]["host_per_node"] for d in disk.values()) +
               min(s["needs"]["host_per_node"] for s in hosted)) / 2  # fmt: skip
    r = tune("--json", "--host-memory", repr(between / 2**30), *small_sub_groups)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    offloaded = {(s["offload"], s["micro_batch"]) for s in doc["ranked"] if s["offload"] != "none"}
    assert offloaded == {("nvme", 1), ("nvme", 2)}
    assert all(s["pruned"].startswith("host per node") for s in doc["pruned"])


def test_an_nvme_setup_goes_untraced_where_its_host_twin_misses_the_gpu_and_would_have_missed_it_too(tune, answer):
    """Planted: a GPU limit between the host twin's needs at micro-batch 1 and 2. At 2 the twin does not fit, and
    the NVMe setup, which needs no less, is pruned untraced; traced alone, it indeed needs more than the limit."""
    twin = {s["micro_batch"]: s["needs"]["gpu"] for s in answer["ranked"] if s["offload"] == "optimizer+params"}
    limit = (twin[1] + twin[2]) / 2
    r = tune("--json", "--gpu-memory", repr(limit / 0.8 / 2**30))  # the default reserve keeps 20% free
    assert r.returncode == 0, r.stderr
    disk = {s["micro_batch"]: s for s in json.loads(r.stdout)["pruned"] if s["offload"] == "nvme"}
    assert disk[2]["needs"] is None and disk[2]["pruned"].startswith("GPU: its host twin (zero3 (stage 3) + offload ")
    assert "already does not fit, and it needs no less (not traced)" in disk[2]["pruned"]
    r = tune("--json", "-o", "nvme")
    assert r.returncode == 0, r.stderr
    traced = {s["micro_batch"]: s["needs"]["gpu"] for s in json.loads(r.stdout)["ranked"]}
    assert traced[2] > limit


def test_a_second_question_takes_every_trace_from_the_cache(tune, answer):
    r = tune("--json")
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert all(s["cached"] for s in again["ranked"])
    assert [s["name"] for s in again["ranked"]] == [s["name"] for s in answer["ranked"]]
    assert again["seconds"] < answer["seconds"]


def test_the_gpu_limit_prunes_exactly_the_setups_whose_traced_peak_exceeds_it(tune, answer):
    """A GPU sized so its usable share falls between two traced needs: those above are pruned with their
    overshoot, those at or below kept, none misplaced. Some are pruned untraced (model states alone over the GPU
    by the formulas; a larger micro-batch of a setup that did not fit; an NVMe setup whose host twin did not):
    the unlimited answer shows each of those needs more than the limit too, so the shortcuts lost no setup that
    fits."""
    needs = sorted({r["needs"]["gpu"] for r in answer["ranked"]})
    cut = (needs[len(needs) // 2 - 1] + needs[len(needs) // 2]) / 2
    gib = cut / 0.8 / 2**30  # the default reserve keeps 20% free
    r = tune("--json", "--gpu-memory", repr(gib))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ranked"] and doc["pruned"]
    assert all(s["needs"]["gpu"] <= cut * 1.0001 for s in doc["ranked"])
    traced = [s for s in doc["pruned"] if s["needs"] is not None]
    skipped = [s for s in doc["pruned"] if s["needs"] is None]  # pruned untraced: by the formulas, or micro-batch
    assert traced and all(s["needs"]["gpu"] > cut * 0.9999 and s["pruned"].startswith("GPU: needs") for s in traced)
    assert all("over by" in s["pruned"] for s in traced)
    assert skipped and all("not traced" in s["pruned"] for s in skipped)
    assert any("model states alone: the ZeRO formulas" in s["pruned"] for s in skipped)  # DDP: whole states
    assert any("micro-batch 1 of the same setup already does not fit" in s["pruned"] for s in skipped)
    unlimited = {s["name"]: s["needs"]["gpu"] for s in answer["ranked"]}
    disk = {s["name"] for s in doc["pruned"] + doc["ranked"] if s["offload"] == "nvme"}  # traced where twins go
    assert {s["name"] for s in doc["pruned"]} - disk == {name for name, need in unlimited.items() if need > cut}
    r = tune("--json", "-o", "nvme")  # no host twins asked for: every NVMe setup traced
    assert r.returncode == 0, r.stderr
    disk_need = {s["name"]: s["needs"]["gpu"] for s in json.loads(r.stdout)["ranked"]}
    for s in doc["pruned"] + doc["ranked"]:  # pruned with a twin that does not fit: it would not have either
        if s["offload"] == "nvme" and "already does not fit" in (s["pruned"] or "x"):
            assert disk_need[s["name"]] > cut, s
        elif s["offload"] == "nvme" and s["pruned"] is None:
            assert disk_need[s["name"]] <= cut, s


def test_host_memory_per_node_prunes_the_offloaded_setups(tune, answer):
    """Host memory per node below what the offloaded setups keep there (two ranks' worth): they go, the rest stay;
    the NVMe setups are traced now that their host twins do not fit, and judged by their own host need."""
    hosted = [r for r in answer["ranked"] if r["needs"]["host_per_node"] > 0]
    assert hosted
    smallest = min(r["needs"]["host_per_node"] for r in hosted)
    r = tune("--json", "--host-memory", repr(smallest / 2 / 2**30))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {s["name"] for s in doc["pruned"] if s["offload"] != "nvme"} == {s["name"] for s in hosted}
    disk = [s for s in doc["ranked"] + doc["pruned"] if s["offload"] == "nvme"]
    assert len(disk) == 2 and all(s["needs"] is not None for s in disk)
    assert all(s["pruned"].startswith("host per node") for s in doc["pruned"])


def test_the_table_shows_the_ranking_each_implementations_best_and_the_error(tune, answer):
    r = tune("--top", "3")
    assert r.returncode == 0, r.stderr
    assert "each implementation's best" in r.stdout and "measured error" in r.stdout
    assert r.stdout.count("micro-batch") >= 3 + 2
    assert "8 of 10 setups fit; 2 pruned" in r.stdout and "its host twin" in r.stdout


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--global-batch", "100"), "not a whole number of micro-steps"),
        (("--gpu-memory", "0.0000001"), "no setup fits; the nearest is"),
        (("--nodes", "3"), "does not divide --gpus"),
        (("--cluster", "nowhere"), "--cluster"),
        (("--micro-batch", "0"), "--micro-batch must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tune, answer, extra, says):
    r = tune(*extra)
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("zbench: error:") and says in last


def test_an_unknown_model_is_one_line(cli):
    r = cli("tune", "--model", "gpt-9000", "--cluster", "cpu-2core")
    assert r.returncode == 2 and "unknown model" in r.stderr


def _question(**overrides) -> Question:
    fields = dict(model="tiny", gpus=2, precision="fp32", seq_len=32, implementations=("ddp",), offloads=("none",),
                  micro_batches=(1, 2, 3), checkpointing=(False,), global_batch_tokens=None, device="cpu")  # fmt: skip
    return Question(**{**fields, **overrides})


def test_deepspeeds_prefetch_maps_onto_the_blocks_it_fills_and_the_engines_default_is_its_own_setup():
    """DeepSpeed's 50M prefetch elements fill one of gpt-70b's blocks (805M elements each), the reference engine's
    default prefetch: the stand-in is zero3's own setup, no option, traced once for both (a first version named
    ``prefetch 1`` and traced every such setup twice). 500M still fills one block there, all of tiny's two; 0 is
    none. A user's ``--option prefetch`` is zero3's, not DeepSpeed's."""
    from zbench.plan.trace.plan import make_case
    from zbench.tune.deepspeed_estimate import prefetch_blocks, stand_in

    def ds(model: str, **options: object):
        return make_case(model, "deepspeed", 3, "none", gpus=64, precision="bf16", micro_batch=1, seq_len=32,
                         device="cpu", checkpointing=False, options=options)  # fmt: skip

    q = _question(model="gpt-70b", gpus=64, implementations=("zero3", "deepspeed"), options={"prefetch": 2})
    assert stand_in(q, ds("gpt-70b")).options == {}
    assert stand_in(q, ds("gpt-70b", prefetch_size=0)).options == {"prefetch": 0}
    assert [prefetch_blocks(ds(m, prefetch_size=500_000_000)) for m in ("gpt-70b", "tiny")] == [1, 2]
    assert prefetch_blocks(ds("tiny", prefetch_size=1)) == 1


def test_a_global_batch_sets_each_micro_batchs_accumulation_or_leaves_it_out():
    q = _question(global_batch_tokens=2 * 32 * 2 * 8)  # micro-batch 2, 8 micro-steps, 2 GPUs
    assert grad_accum_for(q, 1) == 16 and grad_accum_for(q, 2) == 8 and grad_accum_for(q, 3) is None
    found = search_space(q)
    assert [(c.micro_batch, c.grad_accum) for c in found.cases] == [(1, 16), (2, 8)]
    assert len(found.left_out) == 1 and "micro-batch 3" in found.left_out[0]


def test_the_cache_key_changes_with_every_input_and_a_failed_trace_is_not_kept(tmp_path):
    from zbench.plan.trace.tracer import TraceResult
    from zbench.tune.cache import TraceCache, trace_key

    (case,) = search_space(_question(micro_batches=(1,))).cases
    changes = ({"micro_batch": 2}, {"activation_checkpointing": True}, {"offload": "optimizer"}, {"world_size": 4},
               {"seq_len": 16}, {"options": {"bucket_mb": 1}})  # fmt: skip
    variants = [case.model_copy(update=u) for u in changes]
    keys = {trace_key(c) for c in [case, *variants]}
    assert len(keys) == 1 + len(variants)
    store = TraceCache(tmp_path)
    trace = TraceResult("id", "ddp", 0, "none", 2, 0, True, "cpu", state_bytes={"parameters": {"device": 8}})
    store.put(case, trace)
    assert store.get(case) == trace and store.get(variants[0]) is None
    failed = TraceResult("id", "ddp", 0, "none", 2, 0, True, "cpu", error="RuntimeError: out of memory")
    store.put(variants[0], failed)
    assert store.get(variants[0]) is None
    (tmp_path / f"{trace_key(case)}.json").write_text("{not json")
    assert store.get(case) is None  # a damaged entry traces anew


def test_two_cuts_extrapolated_over_blocks_give_the_whole_models_figures():
    """gpt-350m (24 blocks) traced whole and as its 5- and 6-block cuts: model states, bytes sent and the peak
    (extrapolated segment by segment) equal the whole trace's; the predicted step within 0.5%, as DDP's bucketed
    all-reduces are counted on a line (47 calls for 38), which only their latency feels
    (docs/data/validate_extrapolation.json has every implementation x offload mode at two sizes)."""
    from zbench.plan.simulate.cluster import load
    from zbench.plan.simulate.sweep import estimate_row
    from zbench.plan.trace.plan import make_case, trace_plan
    from zbench.tune.extrapolate import Extrapolated, can_extrapolate, cuts

    cluster = load("h100-sxm")
    # ZeRO-3 with checkpointing: each block's saved input stays to the end of forward, so a block's live bytes grow
    # with its place, the plane's second direction
    setups = (("ddp", 0, False), ("zero3", 3, True))
    cases = [make_case("gpt-350m", name, stage, "none", gpus=2, precision="bf16", micro_batch=1, seq_len=16,
                       device="cpu", checkpointing=ckpt) for name, stage, ckpt in setups]  # fmt: skip
    assert all(can_extrapolate(c) for c in cases)
    said: list[str] = []
    rows = trace_plan([job for c in cases for job in (c, *cuts(c))], device="cpu", progress=said.append)
    assert [line for line in said if line.startswith("[")][:3] == [  # each cut's line says which (not a heartbeat)
        "[1/6] tracing ddp stage 0 offload none",
        "[2/6] tracing ddp stage 0 offload none, cut to 5 blocks",
        "[3/6] tracing ddp stage 0 offload none, cut to 6 blocks",
    ]
    for i, case in enumerate(cases):
        whole, shallow, deeper = rows[3 * i : 3 * i + 3]
        assert shallow.case.model == "gpt-350m@blocks=5" and not whole.trace.error
        line = Extrapolated(case, shallow, deeper)
        ext = line.row()
        assert ext.trace.state_bytes == whole.trace.state_bytes
        for phase, ops in whole.trace.phases.items():  # bytes exact; DDP's bucket count rounds (see the docs)
            for op, e in ops.items():
                assert ext.trace.phases[phase][op]["bytes"] == e["bytes"]
                assert ext.trace.phases[phase][op]["count"] == pytest.approx(e["count"], rel=0.3)
        assert ext.peak() == pytest.approx(whole.peak(), rel=0.001)
        extrapolated_step = estimate_row(ext, cluster, 2, line.phase_compute(cluster, 2)).step_s
        assert extrapolated_step == pytest.approx(estimate_row(whole, cluster, 2).step_s, rel=0.005)
        # and the shallow cut alone is not the whole model: the line is doing the work
        assert deeper.located("device") < 0.5 * whole.located("device")


def test_what_cannot_be_cut_is_traced_whole():
    from zbench.plan.trace.plan import make_case
    from zbench.tune.extrapolate import can_extrapolate

    def case(model, name="ddp", stage=0):
        return make_case(model, name, stage, "none", gpus=2, precision="fp32", micro_batch=1, seq_len=16,
                         device="cpu", checkpointing=False)  # fmt: skip

    assert can_extrapolate(case("gpt-350m"))
    assert not can_extrapolate(case("gpt-350m", "torch_zero", 1))  # declares itself not blockwise
    assert not can_extrapolate(case("gpt-125m"))  # 12 blocks: the cuts hold 11
    assert not can_extrapolate(case("gpt-350m@blocks=8"))  # already a cut


def test_a_setup_that_accumulates_is_not_judged_by_a_larger_micro_batch_that_does_not():
    """With a global batch, micro-batch 1 accumulates over 4 micro-steps (FSDP keeps whole gradients between them)
    and micro-batch 4 does not: not fitting at 1 says nothing about 4. Two that both accumulate are compared."""
    from zbench.tune.search import _siblings

    q = _question(implementations=("fsdp",), micro_batches=(1, 2, 4), global_batch_tokens=4 * 32 * 2)
    by_mb = {c.micro_batch: c for c in search_space(q).cases if c.offload == "none"}
    assert [by_mb[m].grad_accum for m in (1, 2, 4)] == [4, 2, 1]
    assert _siblings(by_mb[1]) == _siblings(by_mb[2]) != _siblings(by_mb[4])


def test_a_transformers_config_that_keeps_its_shapes_still_keys_a_new_trace(tmp_path):
    """A local config.json edited where no parameter shape shows (the norm's epsilon) traces anew."""
    from zbench.cases.hf_models import CONFIG_DIR
    from zbench.tune.cache import trace_key

    source = json.loads((CONFIG_DIR / "llama-2-7b.json").read_text())
    config = source.get("transformers_config", source)
    paths = []
    for i, eps in enumerate((1e-5, 1e-6)):
        path = tmp_path / f"c{i}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**config, "rms_norm_eps": eps}))
        paths.append(str(path))
    (a,) = search_space(_question(model=paths[0], micro_batches=(1,), seq_len=16)).cases
    b = a.model_copy(update={"model": paths[1]})
    assert trace_key(a) != trace_key(b)


# --- what tune hands on: a suite, a DeepSpeed config; DeepSpeed estimated; --verify's refusal -------------------

DEEPSPEED_BASE = ("tune", "--model", "tiny", "--gpus", "2", "--cluster", "cpu-2core", "-i", "zero1", "-i", "zero3",
                  "-i", "deepspeed", "--micro-batch", "1", "--checkpointing", "off", "--precision", "fp32")  # fmt: skip


@pytest.fixture(scope="module")
def with_deepspeed(cli, cache_dir, tmp_path_factory):
    """zero1, zero3 and DeepSpeed (estimated from them) at micro-batch 1, the top 4 and DeepSpeed's best written."""
    out = tmp_path_factory.mktemp("emitted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
        r = cli(*DEEPSPEED_BASE, "--json", "--top", "4", "--emit-suite", str(out / "chosen.yaml"),
                "--emit-deepspeed", str(out / "ds.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), out


def test_deepspeed_is_estimated_from_the_same_stages_trace_with_its_own_layout(with_deepspeed, cache_dir, monkeypatch):
    """Each DeepSpeed setup is its stand-in's trace, the reference engine at the same stage, at stage 1 with flat
    groups of DeepSpeed's bucket bytes (50M fp32 elements: 190.7 MiB), at stage 3 prefetching the blocks DeepSpeed's
    prefetch bucket fills (50M elements: both of tiny's), the trace the search made (found in its cache): the same
    predicted step (nothing overlaps on this CPU profile), the activations and buffers the stand-in's trace holds
    beyond its model states, DeepSpeed's declared model states in place of the stand-in's, and at stage 3 DeepSpeed's
    standing gradient bucket (tests/test_deepspeed_buffers.py reads it off a real engine); labelled as estimated."""
    from zbench.cases.formulas import placement_for
    from zbench.plan.simulate.cluster import load
    from zbench.plan.trace.plan import make_case
    from zbench.run.aggregate import declared_layout
    from zbench.tune.cache import TraceCache
    from zbench.tune.deepspeed_estimate import bucket_buffer_bytes
    from zbench.tune.search import GIB, Limits, search
    from zbench.tune.tracers import Tracers

    monkeypatch.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
    doc, _ = with_deepspeed
    every = doc["ranked"] + doc["pruned"]
    ds = [s for s in every if s["implementation"] == "deepspeed"]
    # DeepSpeed runs stages 1-3 with none / optimizer / optimizer+params; zero1 and zero3 were searched
    assert len(ds) == 5 and {(s["stage"], s["offload"]) for s in ds} == {
        (1, "none"), (1, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")
    }  # fmt: skip
    assert any("deepspeed: estimated, not traced" in line for line in doc["left_out"])
    cluster = load("cpu-2core")
    limits = Limits(gpu_bytes=cluster.memory_gib * GIB, reserve=doc["limits"]["reserve"], host_bytes_per_node=None,
                    disk_bytes_per_node=None, gpus_per_node=2)  # fmt: skip
    for s in ds:
        mapped = {"bucket_mb": 50_000_000 * 4 / 2**20} if s["stage"] == 1 else {"prefetch": 2}
        zero = make_case("tiny", f"zero{s['stage']}", s["stage"], s["offload"], gpus=2, precision="fp32",
                         micro_batch=1, seq_len=32, device="cpu", checkpointing=False, options=mapped)  # fmt: skip
        with Tracers() as tracers:
            (stand_in,) = search([zero], cluster, limits, cache=TraceCache(), tracers=tracers, progress=print)
        assert stand_in.cached, "the search traced the stand-in this test names"
        label = f"zero{s['stage']}, " + ("bucket_mb 190.735" if s["stage"] == 1 else "prefetch 2")
        assert s["estimated_from"] == label and f"(estimated from {label})" in s["name"]
        assert s["estimate"] == json.loads(json.dumps(stand_in.estimate.to_json()))
        case = make_case("tiny", "deepspeed", s["stage"], s["offload"], gpus=2, precision="fp32", micro_batch=1,
                         seq_len=32, device="cpu", checkpointing=False)  # fmt: skip
        place, _ = declared_layout(case)
        host = sum(cat.get("host", 0.0) for cat in place.values())
        assert s["needs"]["host_per_node"] == pytest.approx(host * 2)
        device = sum(cat.get("device", 0.0) for cat in place.values())
        buckets = bucket_buffer_bytes(case)  # stage 3's gradient bucket, which the stand-in has no standing twin of
        assert buckets == (50_000_000 * 4 if s["stage"] == 3 else 0)
        zero_device = stand_in.needs.gpu - (s["needs"]["gpu"] - buckets) + device  # the stand-in's traced states...
        formula = sum(cat.get("device", 0.0) for cat in placement_for(zero).values())
        assert zero_device == pytest.approx(formula, rel=0.05)  # ...are the ZeRO formulas' (a flat rank's few %)


def test_deepspeeds_bucket_goes_to_deepspeed_alone_and_is_its_stand_ins_flat_group(
    with_deepspeed, cli, cache_dir, monkeypatch
):
    """``--option bucket_size=N`` is DeepSpeed's alone (the reference engine would refuse it): its stage-1 setups are
    read off zero1 with flat groups of N fp32 elements, so at 20,000 elements (a fifth of tiny's gradients: five
    reductions and five gathers where the default has one of each) DeepSpeed is predicted slower, with more
    communication exposed. An option that no searched implementation takes is one line, exit 2."""
    monkeypatch.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
    r = cli(*DEEPSPEED_BASE, "--json", "--no-search-options", "--option", "bucket_size=20000")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    every = doc["ranked"] + doc["pruned"]
    zero = [s for s in every if s["implementation"] in ("zero1", "zero3")]
    assert zero and all(not s["options"] for s in zero)
    assert all(s["pruned"] is None for s in zero if s["offload"] != "nvme")
    small, default = (
        next(s for s in d["ranked"] + d["pruned"] if s["implementation"] == "deepspeed" and s["stage"] == 1
             and s["offload"] == "none")
        for d in (doc, with_deepspeed[0])
    )  # fmt: skip
    assert small["options"] == {"bucket_size": 20000} and small["estimated_from"] == "zero1, bucket_mb 0.0762939"
    assert small["estimate"]["exposed_comm_s"] > default["estimate"]["exposed_comm_s"]
    assert small["estimate"]["tokens_per_s_per_gpu"] < default["estimate"]["tokens_per_s_per_gpu"]

    r = cli(*DEEPSPEED_BASE, "--option", "bucket=16")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0
    assert "--option bucket: none of the implementations given takes it" in r.stderr


def test_deepspeeds_overlap_and_prefetch_are_its_stand_ins_serialized_phases_and_prefetch(cli, cache_dir, monkeypatch):
    """On a GPU profile (communication overlaps compute), with buckets of a fifth of tiny's gradients (one bucket
    would end backward, where nothing hides it anyway): DeepSpeed's default at stage 1 leaves ``overlap_comm`` off,
    so backward's reductions are charged as exposed, where ``overlap_comm=true`` hides them as the stand-in does
    and adds a second bucket buffer to the GPU need. At stage 3 a ``prefetch_size`` of 0 is the stand-in without
    prefetch: every gather waited for."""
    monkeypatch.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
    base = (*DEEPSPEED_BASE[:6], "h100-sxm", *DEEPSPEED_BASE[7:], "--json", "--no-search-options")

    def deepspeed(*options: str) -> dict[int, dict]:
        r = cli(*base, *(a for o in options for a in ("--option", o)))
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        return {s["stage"]: s for s in doc["ranked"] if s["implementation"] == "deepspeed" and s["offload"] == "none"}

    bucket = "bucket_size=20000"
    default, overlapped = deepspeed(bucket), deepspeed(bucket, "overlap_comm=true")
    unfetched = deepspeed(bucket, "prefetch_size=0")
    assert default[1]["estimate"]["exposed_comm_s"] > overlapped[1]["estimate"]["exposed_comm_s"]
    assert default[1]["estimate"]["tokens_per_s_per_gpu"] < overlapped[1]["estimate"]["tokens_per_s_per_gpu"]
    assert overlapped[1]["needs"]["gpu"] - default[1]["needs"]["gpu"] == pytest.approx(20_000 * 4)
    assert (default[3]["estimated_from"], unfetched[3]["estimated_from"]) == ("zero3, prefetch 2", "zero3, prefetch 0")
    assert unfetched[3]["estimate"]["exposed_comm_s"] > default[3]["estimate"]["exposed_comm_s"]
    assert overlapped[3]["estimate"] == default[3]["estimate"]  # stage 3 overlaps by DeepSpeed's own default


def test_an_option_reaches_only_the_implementations_that_read_it():
    """``--option`` (tune and ``plan --trace``) gives each implementation the options it declares it reads: DDP is
    not labelled with FSDP's prefetch, and the reference engine, which refuses what it does not know, never gets
    DeepSpeed's bucket_size. An option nobody reads is named with what each reads."""
    from zbench.plan.trace.plan import taken_options, untaken_option

    given = {"bucket_mb": 16.0, "bucket_size": 5_000_000, "prefetch": 2, "backward_prefetch": "post"}
    assert taken_options("ddp", given) == {"bucket_mb": 16.0}
    assert taken_options("zero3", given) == {"bucket_mb": 16.0, "prefetch": 2}
    assert taken_options("deepspeed", given) == {"bucket_size": 5_000_000}
    assert taken_options("fsdp", given) == {"prefetch": 2}
    assert taken_options("fsdp1", given) == {"backward_prefetch": "post"}
    assert taken_options("torch_zero", given) == {}
    assert untaken_option(["ddp", "zero1", "deepspeed"], given) == (
        "--option backward_prefetch: none of the implementations given takes it (ddp: bucket_mb; zero1: bucket_mb, "
        "initial_loss_scale, loss_scale_growth_interval, nvme_chunk_mb, prefetch, reduce_dtype; deepspeed: "
        "bucket_size, config, overlap_comm, prefetch_size)"
    )
    assert untaken_option(["torch_zero"], {"prefetch": 1}).endswith("(they take none)")
    assert untaken_option(["ddp", "fsdp1"], {"bucket_mb": 1, "backward_prefetch": "pre"}) is None


def test_deepspeed_without_its_stand_ins_is_not_searched_and_says_why(cli, cache_dir, monkeypatch):
    monkeypatch.setenv("ZBENCH_CACHE_DIR", str(cache_dir))
    r = cli("tune", "--model", "tiny", "--gpus", "2", "--cluster", "cpu-2core", "-i", "ddp", "-i", "deepspeed",
            "--micro-batch", "1", "--checkpointing", "off", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert not [s for s in doc["ranked"] + doc["pruned"] if s["implementation"] == "deepspeed"]
    assert any("left out (-i zero1 -i zero2 -i zero3)" in line for line in doc["left_out"])


def test_the_emitted_suite_is_the_top_setups_for_zbench_run(with_deepspeed, cli, tmp_path):
    """What ``--emit-suite`` writes is a suite ``zbench run`` expands into exactly the chosen setups, each with a
    DDP reference trained the same way; its header carries each one's prediction."""
    doc, out = with_deepspeed
    text = (out / "chosen.yaml").read_text()
    chosen = doc["ranked"][:4]
    for i, s in enumerate(chosen, 1):
        assert f"# {i}. {s['name']}: " in text
    r = cli("run", str(out / "chosen.yaml"), "--dry-run", "--results", str(tmp_path), "--report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for s in chosen:
        offload = s["offload"].replace("+", "_")
        assert f"tiny-{s['implementation']}-s{s['stage']}-w2-fp32-{offload} " in r.stdout.replace("│", " ")
    assert "tiny-ddp-s0-w2-fp32-none " in r.stdout.replace("│", " ")
    assert f"{len(chosen) + 1} would run" in r.stdout  # + DDP (micro-batch 1: no noise twin to split it)


def test_the_emitted_deepspeed_config_reads_back_as_the_setup_it_was_written_for(with_deepspeed, tmp_path):
    """zbench's own DeepSpeed-config reader maps the emitted file back to the best DeepSpeed setup's stage,
    offload, micro-batch and precision (DeepSpeed itself parses it in the heavy tier)."""
    from zbench.suite.deepspeed_config import read

    doc, out = with_deepspeed
    best = next(s for s in doc["ranked"] if s["implementation"] == "deepspeed")
    mapped = read(out / "ds.json")
    assert mapped.suite["stage"] == best["stage"]
    assert mapped.suite["offload"] == [best["offload"]]
    assert mapped.suite["micro_batch"] == best["micro_batch"] and mapped.suite["precisions"] == ["fp32"]
    raw = json.loads((out / "ds.json").read_text())
    assert raw["train_batch_size"] == best["micro_batch"] * best["grad_accum"] * 2
    assert raw["optimizer"]["type"] == "AdamW" and "zero_force_ds_cpu_optimizer" not in raw


def test_verify_refuses_a_profile_not_calibrated_here(tune, answer):
    r = tune("--verify", "2")
    assert r.returncode == 2
    assert "--verify: the profile 'cpu-2core' was not measured here" in r.stderr.strip().splitlines()[-1]


def test_an_emitted_nvme_setup_swaps_where_nvme_dir_says_or_the_header_asks_for_one(tune, answer, tmp_path):
    import yaml

    r = tune("-o", "none", "-o", "nvme", "--top", "10", "--emit-suite", str(tmp_path / "with.yaml"), "--nvme-dir",
             str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((tmp_path / "with.yaml").read_text())
    assert written["nvme_dir"] == str(tmp_path)
    assert any(e["offload"] == ["nvme"] for e in written["implementations"])
    r = tune("-o", "none", "-o", "nvme", "--top", "10", "--emit-suite", str(tmp_path / "without.yaml"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "without.yaml").read_text()
    assert "# An NVMe-offload setup: set nvme_dir" in text and "nvme_dir" not in yaml.safe_load(text)


def test_a_deepspeed_estimate_carries_deepspeeds_calibrated_host_work_not_the_stand_ins(monkeypatch):
    """Where the profile measured both implementations' host work, a DeepSpeed row is its stand-in's step with the
    difference added (planted: 3 ms per step and 1 ms per block more than zero1's); where it measured only one,
    the stand-in's step unchanged."""
    from zbench.plan.simulate import cluster as cluster_module
    from zbench.plan.simulate.calibration import ImplementationOverhead
    from zbench.plan.simulate.datasheet import DatasheetRates
    from zbench.plan.simulate.step import StepEstimate
    from zbench.plan.trace.plan import make_case
    from zbench.tune.deepspeed_estimate import measured_step_difference

    def overhead(step_us: float, block_us: float) -> ImplementationOverhead:
        return ImplementationOverhead(per_step_us=step_us, per_block_us=block_us, residuals_us={})

    profile = cluster_module.load("cpu-2core")
    zero1 = make_case("tiny", "zero1", 1, "none", gpus=2, precision="fp32", micro_batch=1, seq_len=32, device="cpu",
                      checkpointing=False)  # fmt: skip
    ds = zero1.model_copy(update={"implementation": "deepspeed"})
    overheads = {"zero1-s1": overhead(1000, 500), "deepspeed-s1": overhead(4000, 1500)}
    rates = DatasheetRates(device="cpu", matmul=[], memory_bound=[], op_call_us=1.0, overheads=overheads)
    monkeypatch.setattr(type(profile), "operator_rates", lambda self: rates)
    blocks = 2  # tiny's blocks
    assert measured_step_difference(profile, zero1, ds) == pytest.approx((3000 + 1000 * blocks) * 1e-6)
    base = StepEstimate(world=2, compute_s=0.1, comm_s=0.02, exposed_comm_s=0.02, offload_s=0.0, step_s=0.12,
                        tokens_per_s_per_gpu=1000.0, mfu=0.3, comm_to_compute=0.2, compute_model="operators",
                        hides_gathers=True, phase_comm_s={})  # fmt: skip
    slower = base.with_host_work(0.03)
    assert slower.step_s == pytest.approx(0.15) and slower.tokens_per_s_per_gpu == pytest.approx(800.0)
    assert slower.mfu == pytest.approx(0.24) and slower.exposed_comm_s == base.exposed_comm_s
    del rates.overheads["deepspeed-s1"]  # DeepSpeed not calibrated (not installed where calibrate ran)
    assert measured_step_difference(profile, zero1, ds) == 0.0


def test_a_deepspeed_estimate_adds_deepspeeds_measured_step_over_the_stand_ins_per_element_too(monkeypatch):
    """Where the profile kept every probe's measured step (schema 4), a DeepSpeed row adds the difference of the
    measured steps, operators included, fitted through the probes and taken at the case's model: planted 2 ms per
    step, 0.5 ms per block and 9 ns per parameter element (of a rank's shard: the probes run at world 1) over
    zero1's come back at ``small`` and ``medium``, whose elements no probe had. The residuals (which say otherwise)
    are not read; a fit without the wide probe would miss the element term, 0.18 s of ``medium``'s step at 2
    ranks."""
    from zbench.cases.model_source import model_info
    from zbench.plan.calibrate.overheads import probe_shapes
    from zbench.plan.simulate import cluster as cluster_module
    from zbench.plan.simulate.calibration import ImplementationOverhead
    from zbench.plan.simulate.datasheet import DatasheetRates
    from zbench.plan.trace.plan import make_case
    from zbench.tune.deepspeed_estimate import measured_step_difference

    def overhead(extra: tuple[float, float, float]) -> ImplementationOverhead:
        step_s, block_s, element_s = extra
        measured = {k: (5e-3 + 1e-3 * b + 2e-9 * e + step_s + block_s * b + element_s * e) * 1e6
                    for k, (b, e) in probe_shapes().items()}  # fmt: skip
        return ImplementationOverhead(per_step_us=0, per_block_us=0, residuals_us={}, measured_us=measured)

    overheads = {"zero1-s1": overhead((0, 0, 0)), "deepspeed-s1": overhead((2e-3, 0.5e-3, 9e-9))}
    rates = DatasheetRates(device="cpu", matmul=[], memory_bound=[], op_call_us=1.0, overheads=overheads)
    profile = cluster_module.load("cpu-2core")
    monkeypatch.setattr(type(profile), "operator_rates", lambda self: rates)
    for model in ("small", "medium"):
        zero1 = make_case(model, "zero1", 1, "none", gpus=2, precision="fp32", micro_batch=1, seq_len=32,
                          device="cpu", checkpointing=False)  # fmt: skip
        info = model_info(model)
        expected = 2e-3 + 0.5e-3 * len(info.block_sizes) + 9e-9 * info.parameters / 2  # on a rank's shard of 2
        ds = zero1.model_copy(update={"implementation": "deepspeed"})
        assert measured_step_difference(profile, zero1, ds) == pytest.approx(expected, rel=1e-6)


@pytest.mark.heavy
def test_one_set_of_tracing_processes_serves_every_round_in_its_jobs_order():
    """``Tracers`` start their processes at the first round with traces to run and keep them: two rounds are traced
    by the same processes (a pool per round paid ~4 s of imports in each of a 64-GPU search's seven rounds), each
    round's rows in its jobs' order, each trace handed to ``done`` as it finishes. A search answered from the cache
    starts none (starting them anyway took a warm 64-GPU question from 5.7 s to 9.9 s), nor does a first round of
    one trace."""
    from multiprocessing import active_children

    from zbench.plan.trace.plan import make_case
    from zbench.tune.tracers import Tracers

    cases = [make_case("tiny", name, stage, "none", gpus=2, precision="fp32", micro_batch=1, seq_len=16,
                       device="cpu", checkpointing=False) for name, stage in (("ddp", 0), ("zero3", 3))]  # fmt: skip
    before = {p.pid for p in active_children()}

    def children() -> set[int]:
        return {p.pid for p in active_children()} - before

    with Tracers(workers=2) as tracers:  # one trace and no process yet: traced here
        (row,) = tracers.trace(cases[:1], progress=lambda _: None, done=lambda *_: None)
        assert not row.trace.error and not children()
    heard: list[str] = []
    with Tracers(workers=2) as tracers:
        started: set[int] = set()
        for jobs in (cases, cases[::-1], cases[:1]):  # a round of one, once the processes run, is theirs
            rows = tracers.trace(jobs, progress=lambda _: None, done=lambda job, _row: heard.append(job.case_id))
            assert [r.case for r in rows] == jobs and not any(r.trace.error for r in rows)
            started = started or children()
            assert len(started) == 2 and children() == started
    assert sorted(heard) == sorted(c.case_id for c in cases * 2 + cases[:1])
    assert not children() & started  # and they end with the context


KILLED_PARENT = """
import multiprocessing, os, signal, sys, time
from concurrent.futures import ProcessPoolExecutor
from zbench.tune.tracers import _import_tracer as initializer

if __name__ == "__main__":
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), initializer=initializer)
    busy = [pool.submit(time.sleep, 120) for _ in range(2)]  # two long traces under way
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.2)
    with open(sys.argv[1], "w") as out:
        out.write(" ".join(str(p.pid) for p in multiprocessing.active_children()))
    time.sleep(5)  # the workers' imports done, the sleeps begun
    os.kill(os.getpid(), signal.SIGKILL)  # as a timeout or a cancelled job would
"""


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie nobody has reaped yet has ended


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_tracing_processes_end_when_tune_is_killed(tmp_path):
    """A ``zbench tune`` killed mid-search leaves no tracing process behind: each watches its parent and ends when
    it dies, busy or not (without the watch, two went on for 24 minutes). Planted in a scratch clone, a watch that
    returns at once leaves both workers sleeping after the kill, and this test fails."""
    import subprocess
    import sys
    import time

    pids_file = tmp_path / "pids"
    subprocess.run([sys.executable, "-c", KILLED_PARENT, str(pids_file)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)  # fmt: skip
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _running(p)]
    for p in left:
        os.kill(p, 9)
    assert not left, "tracing processes outlived the killed search"
