"""``zbench plan --trace`` against real runs: the fake trace must see what a real process group sees.

Real gloo groups of 2 and of 4 ranks run ``trace_case(fake=False)`` (real tensors, the same accounting) for
every built-in implementation and offload mode at ``tiny`` and a subset at ``small``; one process
traces the same cases on fake tensors in fake groups of 2 and 4 that mirror gloo. Then per case and world
size (rank 0):

- model-state bytes (by category and location) and the communication volume of a step are equal;
- the peak of live tensor bytes is within 2%, the real group running on the trace's schedule
  (``instant_network``: a collective's first poll waits for it, as a fake collective is done at once;
  without it ZeRO-2/3 free a bucket when a poll finds it done, and the real peak moves with gloo's
  threads); FSDP2 calls ``reduce_scatter_single`` itself, and gloo runs it through a scratch of the
  input's size that surfaces on the calling thread, which the fake group mirroring gloo makes too;
- the real peak of FSDP2, ZeRO-2/3 and FSDP1 can still move upward from run to run on that schedule (at
  ``small``, FSDP2 at world 4, six runs in a row in one process: 23.34 MB five times, 25.28 MB once; ZeRO-3 at
  world 2 once in four full runs): the real group runs those cases several times (``REPEATS``), and the trace
  must equal the lowest real peak within 2% and lie at or below every one of them (within 2%);
- on free-running gloo (no patch) the trace is the lower end of the real peak: 75% to 102% of it.

And the CLI end to end: every built-in traces at 8 ranks, traced states next to the formula.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.conftest import (  # noqa: E402
    child_env,
    hand_back_and_exit,
    launch_rank_scripts,
    make_case,
    trace_test_precision,
)

ALL = [
    ("ddp", 0, "none"), ("fsdp", 3, "none"), ("fsdp", 3, "optimizer+params"), ("torch_zero", 1, "none"),
    ("zero1", 1, "none"), ("zero1", 1, "optimizer"), ("zero2", 2, "none"), ("zero2", 2, "optimizer"),
    ("zero3", 3, "none"), ("zero3", 3, "optimizer+params"), ("zero3", 3, "nvme"),
    ("fsdp1", 0, "none"), ("fsdp1", 2, "none"), ("fsdp1", 3, "none"),
]  # fmt: skip
SMALL = [
    ("ddp", 0, "none"), ("zero1", 1, "none"), ("zero2", 2, "none"), ("zero3", 3, "none"), ("fsdp", 3, "none"),
    ("fsdp1", 2, "none"),
]  # fmt: skip
CASES = [("tiny", *c) for c in ALL] + [("small", *c) for c in SMALL]
PRECISION = trace_test_precision()
"""Mixed precision where the CPU runs bf16 natively, else fp32, which checks the same accounting without the
bf16 copies (``trace_test_precision``; the report header says which)."""
TIMING_FREE = {"ddp", "torch_zero", "zero1"}
WORLDS = (2, 4)
REPEATS = {c: 4 for c in CASES if c[1] not in TIMING_FREE} | {("small", "fsdp", 3, "none"): 8}
"""How often the real group runs each case whose real peak moves from run to run on the instant-network
schedule. FSDP2's real peak at ``small`` is higher now and then (1 run in 6 in one probe, once in a CI run
at world 4) with the cycle collector held off for the step, so not the collector's doing: it follows the
order in which gloo's threads and the backward pass allocate (2 runs in 5 at world 4, 1 in 5 at world 2,
in one test run). ZeRO-3 at ``small``, world 2, did the same once in four full runs (backward's peak
43.89 MB above the optimizer step's 41.91 MB, which four runs in a row and the trace give). At ``tiny`` too:
FSDP2 at stage 3, world 2, once in a CI run on a loaded machine (2026-11-30: backward's last block 99,840 bytes
of backward temporaries above the trace, 1.68 MB against 1.58). The lowest real peak is the schedule the trace
follows."""


def cases(world: int):
    return [
        make_case(model=m, implementation=i, stage=s, offload=o, world_size=world, precision=PRECISION, micro_batch=1)
        for m, i, s, o in CASES
    ]


def key(m: str, i: str, s: int, o: str) -> str:
    return f"{m}-{i}-s{s}-{o}"


def run_real(world: int, rank: int, out: Path) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from zbench.plan.trace.shims import instant_network
    from zbench.plan.trace.tracer import trace_case

    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    cpu = torch.device("cpu")
    results: dict[str, dict] = {}

    def trace_as(name: str, case) -> None:
        # each rank's log (shown when a group fails) says which case it was in: a rank aborted once in a collective
        # the others were not in, at world 4, in CI and once of two local runs beside test_world4 (2026-11-28)
        print(f"rank {rank}: {name}", flush=True)
        results[name] = trace_case(case, fake=False, device=cpu).to_json()

    with instant_network():
        for c, case in zip(CASES, cases(world)):
            trace_as(key(*c), case)
    for c, case in zip(CASES, cases(world)):  # free-running gloo, where its timing moves the peak
        if world == 2 and c[0] == "small" and c[1] not in TIMING_FREE:
            trace_as("as-is:" + key(*c), case)
    for c, repeats in REPEATS.items():  # the cases whose real peak moves from run to run
        case = cases(world)[CASES.index(c)]
        for again in range(1, repeats):
            with instant_network():
                trace_as(f"again{again}:" + key(*c), case)
    hand_back_and_exit(results, out, rank)


FAKE = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.test_trace import CASES, WORLDS, cases, key
from zbench.plan.trace.shims import fake_world
from zbench.plan.trace.tracer import trace_case
out = {{}}
for world in WORLDS:
    with fake_world(world, backend="gloo"):
        out[world] = {{key(*c): trace_case(case, fake=True, device=torch.device("cpu")).to_json()
                      for c, case in zip(CASES, cases(world), strict=True)}}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE.format(root=str(ROOT))],
        env=child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    groups = launch_rank_scripts(__file__, WORLDS, tmp_path_factory.mktemp("trace"), label="real traces")
    stdout, stderr = fake.communicate(timeout=900)
    assert fake.returncode == 0, stderr[-3000:]
    fake_by_world = json.loads(stdout)
    return {w: (groups[w][0], fake_by_world[str(w)]) for w in WORLDS}  # rank 0 of each


@pytest.mark.heavy  # real runs beside traces, at worlds 2 and 4
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: key(*c))
def test_fake_trace_sees_what_a_real_run_sees(traced, case, world):
    real, fake = traced[world]
    r, f = real[key(*case)], fake[key(*case)]
    assert r["error"] is None and f["error"] is None, (r["error"], f["error"])
    assert f["state_bytes"] == r["state_bytes"]
    assert f["comm_elements"] == r["comm_elements"] and f["comm_bytes"] == r["comm_bytes"]
    real_peak, fake_peak = min(real_peaks(real, case)), f["peak"]["device"]["bytes"]
    assert abs(fake_peak - real_peak) <= 0.02 * real_peak, json.dumps([real_peak, fake_peak, r["peak"], f["peak"]])
    assert sum(f["peak"]["device"]["roles"].values()) == fake_peak  # the composition adds up to the peak


def real_peaks(real: dict, case: tuple) -> list[int]:
    """Every real run's peak of ``case``: one, or ``REPEATS[case]`` for a case whose peak moves from run to run."""
    runs = [key(*case)] + [f"again{a}:" + key(*case) for a in range(1, REPEATS.get(case, 1))]
    return [real[run]["peak"]["device"]["bytes"] for run in runs]


@pytest.mark.heavy  # real runs beside traces, at worlds 2 and 4
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("case", list(REPEATS), ids=lambda c: key(*c))
def test_the_trace_is_the_floor_of_a_peak_that_moves_from_run_to_run(traced, case, world):
    real, fake = traced[world]
    peaks = real_peaks(real, case)
    fake_peak = fake[key(*case)]["peak"]["device"]["bytes"]
    print(f"\n{key(*case)}, world {world}: real peaks {peaks}, traced {fake_peak}")
    assert all(p >= 0.98 * fake_peak for p in peaks), (peaks, fake_peak)  # never below the trace


@pytest.mark.heavy  # real runs beside traces, at worlds 2 and 4
@pytest.mark.parametrize(
    "case", [c for c in CASES if c[0] == "small" and c[1] not in TIMING_FREE], ids=lambda c: key(*c)
)
def test_on_a_free_running_network_the_trace_is_the_peaks_lower_end(traced, case):
    """Without the instant-network schedule a buffer lives until a poll finds its collective done: the
    real peak moves with gloo's timing and the trace gives its lower end."""
    real, fake = traced[2]
    real_peak = real["as-is:" + key(*case)]["peak"]["device"]["bytes"]
    fake_peak = fake[key(*case)]["peak"]["device"]["bytes"]
    assert 0.75 * real_peak <= fake_peak <= 1.02 * real_peak, (real_peak, fake_peak)


@pytest.mark.parametrize("model", ["tiny-tied", "tests.plugins.user_models:shared_blocks"])
def test_fake_models_move_to_cuda_with_shared_weights_kept(model):
    """A fake model built on the CPU moves to fake ``cuda`` (presets and user builders): torch 2.14's
    ``Module.to`` swaps fake parameters in place, which the fake mode's weak references forbid ("Couldn't swap
    Embedding.weight", every trace on a CUDA build); ``to_device`` replaces them, a tied weight once. A CPU-only
    torch has no fake ``cuda`` to move to: this runs in CI's second environment (the newest CUDA build)."""
    import torch

    if not torch.cuda._is_compiled():
        pytest.skip("this torch is built without CUDA: no fake cuda device to move to")
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from zbench.cases.model_source import build

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = build(model, seed=0, device="cuda")
    real = build(model, seed=0)
    assert all(isinstance(p, FakeTensor) and p.device.type == "cuda" for p in fake.parameters())
    assert [(n, p.shape, p.requires_grad) for n, p in fake.named_parameters()] == [
        (n, p.shape, p.requires_grad) for n, p in real.named_parameters()
    ]
    shared = {n for n, _ in real.named_parameters(remove_duplicate=False)} - dict(real.named_parameters()).keys()
    assert shared  # both models share weights: the move must keep them shared
    for name in shared:
        owner = dict(real.named_parameters())
        twin = next(n for n in owner if real.get_parameter(n) is real.get_parameter(name))
        assert fake.get_parameter(name) is fake.get_parameter(twin)


def test_live_bytes_counts_frees_roles_and_resizes():
    """The accounting itself, on real tensors: a planted leak, a free, an activation and a resized storage."""
    import torch

    from zbench.plan.trace.live import ACTIVATIONS, HELD, OTHER, LiveBytes

    held = torch.zeros(1000)  # 4000 bytes, alive before the step
    with LiveBytes(torch.device("cpu")) as live:
        live.hold(held)
        live.start_step()
        w = torch.ones(250, requires_grad=True)  # made in the step: 1000 bytes
        tmp = w * 2  # saved? no: mul by a constant saves nothing
        y = (tmp * tmp).sum()  # saves tmp (twice, one storage): an activation
        assert live.peaks["device"].roles[ACTIVATIONS] == 1000
        peak = live.peaks["device"].bytes
        del tmp, y
        assert live.live_bytes("device") < peak  # freed storages leave the books
        big = torch.empty(10_000)  # 40,000 bytes, then shrunk in place as FSDP2 frees its gathers
        big.untyped_storage().resize_(0)
        assert live.live_bytes("device") == 4000 + 1000
        assert live.peaks["device"].bytes >= 4000 + 1000 + 40_000
        assert live.peaks["device"].roles[HELD] == 4000 and OTHER in live.peaks["device"].roles
        del big, w


@pytest.mark.heavy
def test_plan_trace_cli_every_builtin_at_8_ranks(cli):
    r = cli("plan", "--trace", "--model", "tiny", "--gpus", "8", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    names = {(row["implementation"], row["stage"], row["offload"]) for row in rows}
    assert {("ddp", 0, "none"), ("fsdp", 3, "none"), ("zero3", 3, "nvme"), ("torch_zero", 1, "none")} <= names
    for row in rows:
        assert row["trace"]["error"] is None, row
        traced = sum(sum(v.values()) for v in row["trace"]["state_bytes"].values())
        formula = sum(sum(v.values()) for v in row["formula"].values())
        assert traced == pytest.approx(formula, rel=0.05) or row["differences"], row  # a gap is explained
        assert row["trace"]["comm_elements"] > 0


@pytest.mark.heavy
def test_plan_trace_bad_input(cli):
    assert cli("plan", "--trace", "--params", "7e9").returncode == 2
    r = cli("plan", "--trace", "--model", "tiny", "-i", "nope")
    assert r.returncode == 2 and "unknown nope" in r.stderr
    r = cli("plan", "--trace", "--model", "tiny", "--option", "nvme_chunk_mb")
    assert r.returncode == 2 and "expected KEY=VALUE" in r.stderr
    r = cli("plan", "--model", "tiny", "--option", "prefetch=2")
    assert r.returncode == 2 and "add --trace" in r.stderr
    r = cli("plan", "--trace", "--model", "tiny", "-i", "deepspeed")  # installed or not, it does not trace
    assert r.returncode == 2 and "nothing to trace: deepspeed:" in r.stderr


def test_plan_trace_options_reach_the_implementation(cli):
    r = cli("plan", "--trace", "--model", "tiny", "--gpus", "2", "-i", "zero3", "-o", "nvme", "--json",
            "--option", "nvme_chunk_mb=0", "--option", "prefetch=2")  # fmt: skip
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["rows"]
    assert "nvme_chunk_mb must be > 0, got 0" in row["trace"]["error"]


if __name__ == "__main__":
    run_real(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))


@pytest.mark.parametrize("length,chunks", [(10, 4), (3, 8), (1024, 1024), (7, 2), (0, 3), (5, 5), (9, 4), (13, 5)])
def test_fsdp_chunks_made_on_demand_are_torch_chunks(length, chunks):
    """The tracer's lazy stand-in for FSDP2's ``_chunk_with_empty`` gives the same views, padding included."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from zbench.plan.trace.shims import _LazyChunks

    t = torch.arange(length * 3).reshape(length, 3) if length else torch.empty(0, 3)
    eager, lazy = _chunk_with_empty(t, chunks, 0), _LazyChunks(t, chunks, 0)
    assert len(lazy) == len(eager)
    for i in range(-chunks, chunks):
        a, b = eager[i], lazy[i]
        assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
        assert torch.equal(a, b)


HELD = """
import json, torch
from zbench.plan.trace.plan import make_case
from zbench.plan.trace.shims import fake_world
from zbench.plan.trace.tracer import trace_case
out = {}
with fake_world(8):
    for impl, stage in (("fsdp", 3), ("zero3", 3), ("ddp", 0)):
        case = make_case("small", impl, stage, "none", gpus=8, precision="bf16", micro_batch=1, seq_len=128,
                         device="cpu", checkpointing=False)
        out[impl] = trace_case(case, fake=True, device=torch.device("cpu")).to_json()
print(json.dumps(out))
"""


@pytest.mark.heavy
def test_what_is_held_between_steps_is_the_model_states():
    """Held between steps = the model states (+ the batch), for every layout; a buffer freed in place and
    re-allocated during the step (ZeRO-3's and FSDP2's gathered parameters) is not held. A DTensor (FSDP2's parameters,
    gradients and optimizer state) counts its local shard, not its notional global-size storage: counted at
    that size, FSDP2 "held" 48 MB against 7.4 MB of states here."""
    result = subprocess.run(
        [sys.executable, "-c", HELD], env=child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for impl, trace in json.loads(result.stdout).items():
        states = sum(locs["device"] for locs in trace["state_bytes"].values())
        grads = trace["state_bytes"]["gradients"]["device"]  # zero_grad(set_to_none) may free them before the peak
        held = trace["peak"]["device"]["roles"]["held between steps"]
        assert states - grads <= held <= 1.15 * states + 65536, (impl, held, states)


ONE_STEP_MORE = """
import json, torch
from zbench.plan.trace.plan import make_case
from zbench.plan.trace.shims import fake_world
from zbench.plan.trace.tracer import FAKE_STEPS, trace_case
out = {}
with fake_world(4):
    for impl, stage, offload in (("ddp", 0, "none"), ("zero1", 1, "optimizer"), ("zero2", 2, "none"),
                                 ("zero3", 3, "optimizer+params"), ("fsdp", 3, "none"), ("fsdp1", 3, "none"),
                                 ("fsdp1", 0, "none"), ("torch_zero", 1, "none")):
        case = make_case("tiny", impl, stage, offload, gpus=4, precision="bf16", micro_batch=2, seq_len=32,
                         device="cpu", checkpointing=True)
        out[f"{impl}-{stage}-{offload}"] = [trace_case(case, fake=True, device=torch.device("cpu"), steps=steps)
                                            .to_json() for steps in (FAKE_STEPS, FAKE_STEPS + 1)]
print(json.dumps(out))
"""


def test_a_fake_trace_records_what_one_step_more_would():
    """``FAKE_STEPS`` is enough: every built-in that traces records the same model states, collectives, peak and
    operators at one step more, so a trace (and tune's hundred of them) pays no step it does not need."""
    result = subprocess.run(
        [sys.executable, "-c", ONE_STEP_MORE], env=child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for setup, (recorded, one_more) in json.loads(result.stdout).items():
        assert recorded["error"] is None, (setup, recorded["error"])
        for field in ("state_bytes", "collectives", "phases", "peak", "ops"):
            assert recorded[field] == one_more[field], (setup, field)


def test_the_heartbeat_says_what_the_trace_does_until_it_ends():
    import time

    from zbench.plan.trace.heartbeat import Heartbeat

    lines: list[str] = []
    with Heartbeat(lines.append, every_s=0.02) as beat:
        beat.task("zero3 stage 3 offload none")
        beat.phase("step 2 of 3")
        time.sleep(0.3)
    said = len(lines)
    time.sleep(0.1)
    assert said >= 3 and len(lines) == said  # it beat while open, and stopped with the block
    assert lines[-1].startswith("  zero3 stage 3 offload none: step 2 of 3 (") and lines[-1].endswith(" s)")


def test_plan_trace_with_json_beats_on_stderr_and_keeps_stdout_json():
    """A trace of minutes must not be silent, also with --json: progress and heartbeat on stderr only."""
    r = subprocess.run(
        [sys.executable, "-m", "zbench", "plan", "--trace", "--model", "tiny", "--gpus", "8", "-i", "zero3",
         "-o", "none", "--json"],
        env=child_env(ZBENCH_HEARTBEAT_S="0.05"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"][0]["implementation"] == "zero3"
    assert "[1/1] tracing zero3 stage 3 offload none" in r.stderr
    assert "  zero3 stage 3 offload none: " in r.stderr  # at least one heartbeat line
