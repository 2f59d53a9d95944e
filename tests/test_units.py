"""Fast in-process tests: models, suite expansion, formulas, result-store round trip."""

from __future__ import annotations

import json

import pytest
import torch

from zbench.atomic import atomic_write_json
from zbench.cases.case import Case
from zbench.cases.formulas import expected_state_bytes
from zbench.cases.model_source import build, model_info
from zbench.cases.models import GPT, build_model, rank_micro_batches, synthetic_batch
from zbench.presets import PRESETS
from zbench.results import store
from zbench.results.record import SCHEMA_VERSION, CaseRecord, StepSample, StepTimeSummary
from zbench.results.run_info import RunInfo, SuiteInfo
from zbench.suite import config as suite
from zbench.suite import preflight

# --- models -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_counts_are_exact(name):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_parameters


@pytest.mark.parametrize("name", ["small", "llama-3.1-8b-mini", "tests.plugins.user_models:shared_blocks"])
def test_every_kind_of_model_describes_its_shape_as_built(name):
    """What an implementation sees of a model (``ModelShape``: its traffic is declared against it) is the model
    built: its parameters in order, the elements each block holds alone, the root the rest, for a preset, a
    published architecture and a user's builder alike."""
    if "llama" in name:
        pytest.importorskip("transformers")
    shape = model_info(name).shape
    model = build(name, seed=0, device="meta")
    unique = {id(p): p for p in model.parameters()}
    assert shape.parameter_sizes == tuple(p.numel() for p in unique.values())
    assert shape.parameter_shapes == tuple(tuple(p.shape) for p in unique.values())
    own = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    shared = 0
    if name.startswith("tests."):  # blocks 1 and 2 share a mixing weight: neither holds it alone
        from tests.plugins.user_models import WIDTH

        shared = WIDTH * WIDTH
        own[1] -= shared
        own[2] -= shared
    assert list(shape.block_sizes) == own and shape.layers == len(model.blocks)
    assert shape.shared_block_parameters == shared
    assert shape.root_parameters == shape.num_parameters - sum(own) > shared


def test_presets_span_tiny_to_70b():
    assert PRESETS["small"].num_parameters == 3_716_608  # 4 layers, d_model 256, 4 heads, vocab 1024, seq 128
    assert 69e9 < PRESETS["gpt-70b"].num_parameters < 72e9


def test_model_init_is_deterministic_and_seeded():
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_data_is_deterministic_and_split_across_ranks():
    cfg = PRESETS["tiny"]
    batch = synthetic_batch(cfg, seed=0, step=3, rows=8)
    assert torch.equal(batch, synthetic_batch(cfg, seed=0, step=3, rows=8))
    assert not torch.equal(batch, synthetic_batch(cfg, seed=0, step=4, rows=8))
    assert batch.shape == (8, cfg.seq + 1) and int(batch.max()) < cfg.vocab
    shards = [rank_micro_batches(batch, rank=r, world=2, grad_accum=2) for r in range(2)]
    rows = torch.cat([torch.cat([x for x, _ in s]) for s in shards])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, batch[:, :-1].tolist()))
    x, y = shards[0][0]
    assert torch.equal(x[:, 1:], y[:, :-1])


# --- suites -----------------------------------------------------------------------------------------------


def config(**overrides):
    return suite.from_dict(
        {
            "device": "cpu",
            "models": ["tiny"],
            "implementations": ["fsdp", "torch_zero"],
            "world_sizes": [1, 2],
            **overrides,
        }
    )


def expand(cfg):
    """The suite's cases as ``zbench run`` would launch them."""
    return list(preflight.prepare(suite.from_flags(cfg)).cases)


def test_cartesian_product_with_ddp_reference_first():
    """Every implementation at every stage it supports (FSDP2's 2 and 3) after DDP and its twin."""
    cases = expand(config(precisions=["fp32", "bf16"]))
    assert len(cases) == 2 * 2 * 5
    groups = {}
    for c in cases:
        groups.setdefault(c.reference_key, []).append(f"{c.implementation}{'-twin' if c.noise_twin else ''}-s{c.stage}")
    assert all(
        impls[:2] == ["ddp-s0", "ddp-twin-s0"] and sorted(impls[2:]) == ["fsdp-s2", "fsdp-s3", "torch_zero-s1"]
        for impls in groups.values()
    )
    assert len({c.case_id for c in cases}) == len(cases)


def test_noise_twin_splits_the_batch_another_way_or_is_left_out():
    """The twin trains on the same rows (same reference key) in twice or half as many micro-batches."""
    (twin,) = [c for c in expand(config(world_sizes=[2])) if c.noise_twin]
    assert twin.reference_key == expand(config(world_sizes=[2]))[0].reference_key
    assert (twin.micro_batch, twin.micro_batches_per_step) == (4, 2) and twin.case_id.endswith("-twin")
    odd = expand(config(world_sizes=[2], micro_batch=3, grad_accum=2))
    assert [c.micro_batches_per_step for c in odd if c.noise_twin] == [1]
    assert not [c for c in expand(config(world_sizes=[2], micro_batch=3)) if c.noise_twin]
    assert not [c for c in expand(config(world_sizes=[2], noise_twin=False)) if c.noise_twin]


def test_entries_with_their_own_axes_are_setups_each_with_a_ddp_reference_trained_the_same_way():
    """A suite of chosen setups (``tune --emit-suite``): each entry runs at its own offload, micro-batch,
    accumulation and checkpointing; DDP at every one of those shapes and no other; ids name the batch."""
    cases = expand(
        config(
            world_sizes=[2],
            implementations=[
                {"name": "zero2", "offload": "optimizer", "micro_batch": 2, "grad_accum": 2},
                {"name": "fsdp", "stages": [3], "micro_batch": 8, "activation_checkpointing": True},
                "torch_zero",
            ],
        )
    )
    by_impl = {}
    for c in cases:
        by_impl.setdefault(c.implementation + ("-twin" if c.noise_twin else ""), []).append(
            (c.offload, c.micro_batch, c.grad_accum, c.activation_checkpointing)
        )
    assert by_impl["zero2"] == [("optimizer", 2, 2, False)]
    assert by_impl["fsdp"] == [("none", 8, 1, True)]
    assert by_impl["torch_zero"] == [("none", 4, 1, False)]  # the suite's own
    assert (
        sorted(by_impl["ddp"])
        == sorted(by_impl["ddp-twin"])
        == sorted([("none", 2, 2, False), ("none", 8, 1, True), ("none", 4, 1, False)])
    )
    references = {c.reference_key for c in cases if c.implementation == "ddp"}
    assert all(c.reference_key in references for c in cases)
    assert len({c.case_id for c in cases}) == len(cases)
    assert "tiny-zero2-s2-w2-fp32-optimizer-mb2x2" in {c.case_id for c in cases}
    assert "mb" not in expand(config(world_sizes=[2]))[0].case_id  # a cross product's ids are as they were


def test_ddp_listed_at_two_micro_batches_is_one_reference_at_each():
    """A suite of chosen setups may rank DDP at two micro-batches: one DDP case (and twin) per shape, no
    duplicate ids (micro-batch 1 has no twin: one sequence cannot be split)."""
    entries = [{"name": "ddp", "micro_batch": 1}, {"name": "ddp", "micro_batch": 2}, {"name": "fsdp", "micro_batch": 2}]
    cases = expand(config(world_sizes=[2], implementations=entries))
    ids = [c.case_id for c in cases]
    assert len(ids) == len(set(ids))
    assert sorted((c.micro_batch, c.noise_twin) for c in cases if c.implementation == "ddp") == [
        (1, False), (2, False), (2, True)
    ]  # fmt: skip


def test_unsupported_combinations_are_skipped_not_errors():
    cases = expand(config(offload=["none", "optimizer"]))
    skipped = [c for c in cases if c.skip_reason]
    assert skipped and all("offload optimizer not supported" in c.skip_reason for c in skipped)


def test_config_objects_are_frozen():
    cfg = config()
    with pytest.raises(Exception):
        cfg.steps = 3
    with pytest.raises(Exception):
        expand(cfg)[0].steps = 3


def test_case_round_trips_through_json_with_its_capabilities():
    case = expand(config(implementations=[{"name": "fsdp", "options": {"x": 1}}]))[2]
    back = Case.model_validate(json.loads(json.dumps(case.to_json_dict())))
    assert back == case and back.case_id == case.case_id
    assert back.capabilities is not None and back.capabilities.stages == frozenset({2, 3})


def test_case_ids_cannot_escape_the_results_directory():
    case = expand(config(implementations=["tests.plugins.faulty:FAULTY"]))[2]
    assert "/" not in case.case_id and ":" not in case.case_id and not case.case_id.startswith(".")


def test_warmup_must_be_shorter_than_steps():
    with pytest.raises(Exception, match="warmup_steps"):
        config(steps=3, warmup_steps=3)


# --- formulas ---------------------------------------------------------------------------------------------


def test_zero_paper_formulas_mixed_precision():
    psi, n = 1_000_000, 8
    total = lambda stage: sum(expected_state_bytes(params=psi, world=n, stage=stage, precision="bf16").values())
    assert total(0) == 16 * psi
    assert total(1) == pytest.approx(4 * psi + 12 * psi / n)
    assert total(2) == pytest.approx(2 * psi + 14 * psi / n)
    assert total(3) == pytest.approx(16 * psi / n)


def test_formulas_fp32():
    by_cat = expected_state_bytes(params=100, world=4, stage=2, precision="fp32")
    assert by_cat == {"parameters": 400, "gradients": 100, "optimizer_state": 200, "master_weights": 0}


# --- store ------------------------------------------------------------------------------------------------


def test_store_round_trip(tmp_path):
    run = store.RunDir(tmp_path, store.new_run_id())
    run.start(RunInfo(run_id=run.run_id, suite=SuiteInfo(name="t"), git_sha="abc"))
    case = expand(config())[0]
    record = CaseRecord(
        config=case,
        status="ok",
        summary=StepTimeSummary(step_time_median_s=0.5),
        steps=[StepSample(step=i, loss=2.0 - i, step_time_s=0.5, warmup=i == 0) for i in range(3)],
    )
    run.write_case(record)
    run.finish()
    raw = json.loads(run.case_path(case.case_id).read_text())
    assert raw["schema_version"] == SCHEMA_VERSION and raw["run_id"] == run.run_id
    assert raw["case_id"] == case.case_id and raw["config"]["implementation"] == "ddp"
    back = run.cases()[0]
    assert back.steps == record.steps and back.config == case and back.run_id == run.run_id
    assert store.RunDir(tmp_path, run.run_id).info().ended_at
    df = store.load_cases(tmp_path)
    assert df.loc[0, "case_id"] == case.case_id and df.loc[0, "step_time_median_s"] == 0.5
    steps = store.load_steps(tmp_path)
    assert steps["loss"].tolist() == [2.0, 1.0, 0.0] and steps["warmup"].tolist() == [True, False, False]
    assert store.latest_run(tmp_path).run_id == run.run_id


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "x.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


# --- instruments --------------------------------------------------------------------------------------------


def test_nvml_sampler_reports_unavailable_instead_of_failing():
    from zbench.measure.nvml import NvmlSampler

    out = NvmlSampler(0).start().stop()
    if not out["available"]:
        assert out["reason"]
    else:  # a machine with a GPU
        assert out["samples"] >= 1


def test_energy_per_step_counts_the_timed_steps_only():
    from zbench.results.record import NvmlSummary
    from zbench.run.aggregate import energy_summary

    rank = NvmlSummary(available=True, peak_used_bytes=10, energy_j=1000.0, energy_timed_j=300.0)
    out = energy_summary(
        [rank, rank.model_copy(update={"energy_timed_j": 100.0})], timed_steps=10, tokens_per_step=1000
    )
    assert out.energy_j == 2000.0 and out.energy_timed_j == 400.0
    assert out.energy_per_step_j == 40.0 and out.energy_per_token_j == 0.04
    assert (
        energy_summary([NvmlSummary(available=False, reason="CPU run")], timed_steps=2, tokens_per_step=1).available
        is False
    )


def test_mfu_uses_the_gpu_peak_and_can_be_overridden(monkeypatch):
    from zbench.measure.flops import derived, peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops(None, "bf16") is None
    cfg = PRESETS["small"]
    d = derived(
        cfg,
        seq=cfg.seq,
        tokens_per_step=1_000_000,
        step_time_s=1.0,
        world=1,
        precision="bf16",
        gpu_name="NVIDIA A100-SXM4-80GB",
    )
    assert d["mfu"] == pytest.approx(cfg.flops_per_token() * 1e6 / 1e12 / 312.0)
    # a suite that trains on shorter sequences than the preset's context does less attention work per token
    short = derived(cfg, seq=cfg.seq // 2, tokens_per_step=1_000_000, step_time_s=1.0, world=1, precision="bf16",
                    gpu_name="NVIDIA A100-SXM4-80GB")  # fmt: skip
    attention_half = 6 * cfg.layers * cfg.heads * cfg.head_dim * (cfg.seq // 2)
    assert short["model_flops_per_token"] == d["model_flops_per_token"] - attention_half
    monkeypatch.setenv("ZBENCH_PEAK_TFLOPS", "100")
    assert peak_tflops(None, "fp32") == 100.0


@pytest.mark.parametrize(
    "path", sorted(__import__("pathlib").Path(__file__).resolve().parent.parent.glob("suites/*.yaml"))
)
def test_shipped_suites_are_valid(path):
    """GPU suites cannot be expanded on a CPU machine, but they must still validate."""
    import yaml

    config = suite.from_dict(yaml.safe_load(path.read_text()), source=str(path))
    assert config.models and config.implementations


def test_ledger_records_collectives_and_logical_labels():
    import torch.distributed as dist

    from zbench.comm_labels import recorded_as
    from zbench.measure import comms

    store = dist.TCPStore("127.0.0.1", 0, 1, True)  # port 0: a free one, chosen by the store
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        comms.install()
        comms.take()
        t = torch.ones(10)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        with recorded_as("reduce_scatter", 10):
            dist.all_reduce(t)
        got = {(e["op"], e["dtype"]): (e["count"], e["elements"], e["bytes"]) for e in comms.take()}
        assert got == {
            ("all_reduce", "float32"): (1, 20, 80),
            ("broadcast", "float32"): (1, 10, 40),
            ("reduce_scatter", "float32"): (1, 10, 40),
        }
        comms.uninstall()
        dist.all_reduce(t)
        assert comms.take() == []
    finally:
        comms.uninstall()
        dist.destroy_process_group()


def test_activation_checkpointing_recomputes_every_block_in_backward(monkeypatch):
    from zbench.cases.models import Block, checkpoint_blocks

    calls = []
    forward = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, x: calls.append(1) or forward(self, x))
    model = checkpoint_blocks(build_model("tiny", seed=0))
    batch = synthetic_batch(PRESETS["tiny"], seed=0, step=0, rows=2)
    model(batch[:, :-1], batch[:, 1:]).backward()
    assert len(calls) == 2 * PRESETS["tiny"].layers  # once in forward, once more in backward


def test_case_ids_and_reference_groups_tell_checkpointing_apart():
    plain, ckpt = (c for c in expand(config(world_sizes=[2], activation_checkpointing=[False, True])) if c.is_reference)
    assert ckpt.case_id.endswith("-ckpt") and plain.reference_key != ckpt.reference_key


# --- GPU path inventory (tests/benchmarks/gpu_only_lines.py) ---------------------------------------------

GPU_PATHS = """
def f(device):
    x = 1
    if device.type == "cuda":
        torch.cuda.synchronize()      # GPU
    else:
        x = 3
    return x


def g():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated()      # GPU


def h(handle, gpus, t):
    if handle is None:
        return 0
    if gpus:
        return len(gpus)
    if t.is_pinned():
        return 2      # GPU
    return 1


def nvml_power():
    return 5      # GPU
"""


def test_gpu_inventory_finds_gpu_branches_and_only_them():
    from tests.benchmarks.gpu_only_lines import gpu_branches

    guards = gpu_branches(GPU_PATHS)
    lines = GPU_PATHS.splitlines()
    gpu = {i for i, text in enumerate(lines, 1) if text.endswith("# GPU")}
    assert {i for i in guards.guard if lines[i - 1].strip()} == gpu
    assert guards.function[5] == "f" and guards.function[14] == "g"


def test_a_deepspeed_build_lock_left_by_a_killed_build_is_refused_not_waited_on(tmp_path, monkeypatch):
    """torch's extension builds wait on a lock file without end; one older than any build (a killed build's) fails
    the DeepSpeed case at once, naming the file, while a fresh one (a build under way on another rank) is waited on.
    """
    import os
    import time

    import torch.utils.cpp_extension

    from zbench.implementations import deepspeed_zero

    lock = tmp_path / "deepspeed_shm_comm" / "lock"  # torch builds in $TORCH_EXTENSIONS_DIR itself when it is set
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    # a torch whose builds wait for the file to go (up to 2.13; the newest one is tested below)
    monkeypatch.setattr(torch.utils.cpp_extension, "FileBaton", object, raising=False)
    assert deepspeed_zero.stale_build_locks() == {}  # a build under way
    old = time.time() - deepspeed_zero.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    assert list(deepspeed_zero.stale_build_locks()) == [lock]
    assert deepspeed_zero.stale_build_locks(now=old + 1) == {}
    with pytest.raises(RuntimeError, match=r"deepspeed_shm_comm/lock is 11 minutes old: .*delete the file"):
        deepspeed_zero.clear_build_locks()
    # torch 2.14 holds an advisory lock on the file and leaves the file after every build: never reported there
    monkeypatch.delattr(torch.utils.cpp_extension, "FileBaton")
    assert deepspeed_zero.stale_build_locks() == {}


def test_a_lock_left_by_a_finished_build_is_removed_not_refused(tmp_path, monkeypatch):
    """torch 2.14 leaves its lock file after every build, in the folder torch 2.11 (built for the same CUDA) uses
    too; 2.11 waits for the file to go. A lock older than the module its build wrote is such a leftover: removed
    before DeepSpeed loads, while one newer than the module (a rebuild under way) stays, and an old one without a
    newer module is still a killed build's."""
    import os
    import time

    import torch.utils.cpp_extension

    from zbench.implementations import deepspeed_zero

    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    lock, built = folder / "lock", folder / "deepspeed_shm_comm.so"
    lock.touch()
    built.touch()
    old = time.time() - deepspeed_zero.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "FileBaton", object, raising=False)
    assert deepspeed_zero.finished_build_locks() == [lock] and deepspeed_zero.stale_build_locks() == {}
    deepspeed_zero.clear_build_locks()
    assert not lock.exists() and built.exists()

    lock.touch()  # a rebuild under way: its lock is newer than the module
    deepspeed_zero.clear_build_locks()
    assert lock.exists()
    os.utime(built, (old - 60, old - 60))  # a killed rebuild: an old lock, the module older still
    os.utime(lock, (old, old))
    assert deepspeed_zero.finished_build_locks() == [] and list(deepspeed_zero.stale_build_locks()) == [lock]
    with pytest.raises(RuntimeError, match="delete the file"):
        deepspeed_zero.clear_build_locks()


def test_a_stale_build_lock_of_another_torch_build_is_not_this_ones(tmp_path, monkeypatch):
    """Without $TORCH_EXTENSIONS_DIR each Python x accelerator build of torch has its own folder under the default
    root. A lock left by the CUDA build of torch in its folder never blocks the CPU build's DeepSpeed (the heavy tier
    failed every DeepSpeed case on such a lock once), while one in this build's folder is still found."""
    import os
    import sys
    import time

    import torch.utils.cpp_extension

    from zbench.implementations import deepspeed_zero

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "FileBaton", object, raising=False)  # files that block
    mine = deepspeed_zero.extension_build_root()
    assert mine.parent == tmp_path and mine.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")
    old = time.time() - deepspeed_zero.STALE_BUILD_LOCK_S - 60
    theirs = tmp_path / "py311_cu999" / "deepspeed_shm_comm" / "lock"
    for lock in (theirs, mine / "deepspeed_shm_comm" / "lock"):
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
        os.utime(lock, (old, old))
    assert list(deepspeed_zero.stale_build_locks()) == [mine / "deepspeed_shm_comm" / "lock"]


def test_deepspeed_cases_are_skipped_with_the_install_hint_where_it_is_absent(monkeypatch):
    """The adapter imports without DeepSpeed; its capabilities then say why nothing can run."""
    import importlib.util

    from zbench.implementations.deepspeed_zero import IMPLEMENTATION, INSTALL_HINT

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    reason = IMPLEMENTATION.capabilities.why_unsupported(
        stage=3, precision="fp32", offload="none", device="cpu", optimizer="adamw", grad_accum=1, grad_clip=None
    )
    assert reason == INSTALL_HINT and "pip install" in reason
