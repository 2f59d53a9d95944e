"""Several nodes, played by several harnesses on loopback: the same suite, the same numbers as one node.

Each "node" is a real ``zbench run --nnodes 2 --node-rank R --rdzv-endpoint
127.0.0.1:PORT`` process with one rank; the elastic agents of the two meet at
node 0's store, exactly as on two machines. The SLURM launcher runs through
``tests/tools/srun``, a stand-in for srun on one host (two tasks, the variables
srun sets). Every rank gets one thread, as each rank of a single-node world-2
run on these 2-core machines does: CPU kernels split their sums by thread
count, and the losses are compared bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, CLIResult, child_env, zbench, zbench_many
from zbench.ports import free_port
from zbench.results.run_info import Environment, RunInfo, SuiteInfo
from zbench.verdicts.regress import machine_fingerprint

FAULTY = "tests.plugins.faulty:FAULTY"
#: suites/stages.yaml shrunk to what a test can afford: the tiny model, 5 steps, fp32, no paired timing rounds (the
#: gate's; tested in test_regress), and one case of each family
#: (with the DDP reference and its twin); the full smoke and stages suites were compared by hand (closing note).
#: The timeout is generous: the module runs four suites at once, on a machine that may be busy besides.
SHRINK = ["--set", "models=[tiny]", "--set", "steps=5", "--set", "warmup_steps=1", "--set", "precisions=[fp32]",
          "--set", "timeout_s=900", "--set", "paired_rounds=0"]  # fmt: skip
FAMILIES = ["-k", "zero1", "-k", "zero3", "-k", "fsdp-s3", "-k", "fsdp1-s2", "-k", "deepspeed-s3"]


def kill_suite(name: str, implementations: str) -> str:
    """A tiny world-2 suite of ``implementations`` (YAML flow-list items), for the killed-rank tests."""
    return f"""
name: {name}
device: cpu
models: tiny
world_sizes: 2
steps: 6
warmup_steps: 1
paired_rounds: 0
timeout_s: 900
implementations: [{implementations}]
"""


KILL_SUITE = kill_suite("kill-on-node-1", f'ddp, {{name: "{FAULTY}", options: {{fault: sigkill_marked}}}}, torch_zero')
SRUN_KILL_SUITE = kill_suite("srun-kill", f'ddp, {{name: "{FAULTY}", options: {{fault: sigkill}}}}')


def start(args: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "zbench", *args],
        cwd=ROOT,
        env=child_env(COLUMNS="200", ZBENCH_THREADS_PER_RANK="1", **env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 900) -> CLIResult:
    out, err = proc.communicate(timeout=timeout)
    return CLIResult(proc.returncode, out, err)


def two_nodes(suite: str, results: Path, *extra: str, node1_env: dict[str, str] | None = None) -> list[CLIResult]:
    """Node 0 and node 1 of one run. The free port is free when found, not when node 0 binds it seconds later (a
    test module on the other worker, or any program, may take it meanwhile): taken, node 0 fails in one line
    before anything runs, and the pair starts again on another port."""
    for _ in range(3):
        endpoint = f"127.0.0.1:{free_port()}"
        common = [suite, "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-timeout", "300", *extra]
        node0 = start(
            ["run", *common, "--node-rank", "0", "--results", str(results), "--report", str(results / "report")]
        )
        node1 = start(["run", *common, "--node-rank", "1", "--results", str(results / "node1")], **(node1_env or {}))
        first = finish(node0)
        if first.returncode == 2 and "cannot host the rendezvous store" in first.stderr:
            node1.kill()
            node1.communicate()
            continue
        return [first, finish(node1)]
    raise AssertionError(f"node 0 could not host the rendezvous store three times: {first.stderr[-2000:]}")


def records(results: Path) -> dict[str, dict]:
    (run,) = [p for p in results.iterdir() if (p / "run.json").exists()]
    return {p.stem: json.loads(p.read_text()) for p in (run / "cases").glob("*.json")}


def run_info(results: Path) -> dict:
    (run,) = [p for p in results.iterdir() if (p / "run.json").exists()]
    return json.loads((run / "run.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """suites/stages.yaml (shrunk) on one node and on two loopback nodes, smoke.yaml under srun; all at once."""
    tmp = tmp_path_factory.mktemp("multinode")
    suite = str(ROOT / "suites" / "stages.yaml")
    fake_srun = {"PATH": f"{ROOT / 'tests' / 'tools'}{os.pathsep}{os.environ['PATH']}"}
    single = start(
        ["run", suite, *SHRINK, *FAMILIES, "--results", str(tmp / "one"), "--report", str(tmp / "one-report")]
    )
    smoke = str(ROOT / "suites" / "smoke.yaml")  # its DDP and FSDP2 cases are stages' too
    srun = start(
        [
            "run",
            smoke,
            *SHRINK,
            "-k",
            "fsdp-s3",
            "--launcher",
            "slurm",
            "--results",
            str(tmp / "srun"),
            "--report",
            str(tmp / "r"),
        ],
        **fake_srun,
    )
    (tmp / "kill.yaml").write_text(SRUN_KILL_SUITE)
    srun_kill = start(
        [
            "run",
            str(tmp / "kill.yaml"),
            "--launcher",
            "slurm",
            "--results",
            str(tmp / "srun-kill"),
            "--report",
            str(tmp / "srun-kill-report"),
        ],
        **fake_srun,
    )
    nodes = two_nodes(suite, tmp / "two", *SHRINK, *FAMILIES)
    return {
        "one": (finish(single), tmp / "one"),
        "two": (nodes, tmp / "two"),
        "srun": (finish(srun), tmp / "srun"),
        "srun-kill": (finish(srun_kill), tmp / "srun-kill"),
    }


#: The fast tier's walk through the multi-node launcher: two loopback nodes train a suite that names a DeepSpeed
#: config (ZeRO-2, fp32) under DDP, DeepSpeed and FSDP1, the adapters no other fast test launches. Meanwhile the
#: SLURM launcher runs the reference ZeRO-3 swapping its state to files (NVMe offload) through tests/tools/srun.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2},
}
FAST_NODES_SUITE = """
name: two-nodes-ds-config
device: cpu
models: tiny
implementations: [ddp, deepspeed, fsdp1]
world_sizes: 2
deepspeed_config: ds.json
steps: 4
warmup_steps: 1
paired_rounds: 0
noise_twin: false
timeout_s: 600
"""
FAST_SRUN_SUITE = """
name: srun-nvme
device: cpu
models: tiny
implementations: [ddp, zero3]
world_sizes: 2
offload: nvme
nvme_dir: {nvme}
steps: 4
warmup_steps: 1
paired_rounds: 0
noise_twin: false
timeout_s: 600
"""


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory):
    """The DeepSpeed-config suite on two loopback nodes and the NVMe suite under srun, all at once."""
    tmp = tmp_path_factory.mktemp("fast-nodes")
    (tmp / "ds.json").write_text(json.dumps(DS_CONFIG))
    (tmp / "nodes.yaml").write_text(FAST_NODES_SUITE)
    (tmp / "nvme").mkdir()
    (tmp / "srun.yaml").write_text(FAST_SRUN_SUITE.format(nvme=tmp / "nvme"))
    fake_srun = {"PATH": f"{ROOT / 'tests' / 'tools'}{os.pathsep}{os.environ['PATH']}"}
    srun = start(
        ["run", str(tmp / "srun.yaml"), "--launcher", "slurm", "--results", str(tmp / "srun"), "--report",
         str(tmp / "srun-report")],
        **fake_srun,
    )  # fmt: skip
    nodes = two_nodes(str(tmp / "nodes.yaml"), tmp / "two")
    return {"two": (nodes, tmp / "two"), "srun": (finish(srun), tmp / "srun"), "nvme": tmp / "nvme"}


def test_two_nodes_train_a_deepspeed_config_like_ddp(fast_runs):
    (node0, node1), results = fast_runs["two"]
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    got = {r["config"]["implementation"]: r for r in records(results).values()}
    assert set(got) == {"ddp", "deepspeed", "fsdp1"}, sorted(got)
    for name, record in got.items():  # the config's settings, mapped onto every implementation
        settings = [record["config"][key] for key in ("micro_batch", "grad_clip", "lr", "weight_decay")]
        assert settings == [2, 1.0, 0.001, 0.01], (name, settings)
        assert record["status"] == "ok", (name, record.get("error"))
    for name in ("deepspeed", "fsdp1"):
        record = got[name]
        assert record["equivalence"]["equivalent"] is True, (name, record["equivalence"])
        assert record["config"]["stage"] == 2 and record["config"]["world_size"] == 2
    assert got["deepspeed"]["config"]["options"]["config"] == DS_CONFIG  # DeepSpeed trains the whole file
    assert "node 0 stored the results" in node1.stderr
    assert len(run_info(results)["nodes"]) == 2
    assert (results / "report" / "index.html").exists()


def test_srun_runs_the_reference_engine_swapping_to_nvme_like_ddp(fast_runs):
    result, results = fast_runs["srun"]
    assert result.returncode == 0, result.stderr[-3000:]
    got = {r["config"]["implementation"]: r for r in records(results).values()}
    assert got["ddp"]["config"]["offload"] == "none"  # the reference never offloads
    zero3 = got["zero3"]
    assert zero3["status"] == "ok" and zero3["equivalence"]["equivalent"] is True, zero3.get("error")
    assert zero3["config"]["offload"] == "nvme"
    disk = zero3["model_state"]["by_location"]["disk"]
    assert disk["measured"] > 0 and disk["measured"] == disk["predicted"]  # it swapped what the formulas place there
    assert list(fast_runs["nvme"].iterdir()) == []  # and each case's swap directory is gone with it


def _same_as_one_node(one: dict[str, dict], other: dict[str, dict]) -> None:
    """Every case of ``other`` has the status, losses, final parameters, traffic and verdict of its twin in ``one``."""
    assert set(other) <= set(one)
    for case_id, theirs in other.items():
        record = one[case_id]
        assert theirs["status"] == record["status"], (case_id, theirs.get("error"))
        if record["status"] != "ok":
            continue
        assert [s["loss"] for s in theirs["steps"]] == [s["loss"] for s in record["steps"]], case_id
        assert theirs["param_checksums"] == record["param_checksums"], case_id
        assert theirs["comms"]["per_step_elements"] == record["comms"]["per_step_elements"], case_id
        assert theirs["equivalence"]["equivalent"] == record["equivalence"]["equivalent"], case_id


@pytest.mark.heavy
def test_two_nodes_give_the_single_node_verdicts_losses_and_traffic(runs):
    (single, one), ((node0, node1), two) = runs["one"], runs["two"]
    assert single.returncode == 0, single.stderr[-3000:]
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    ran = [case_id for case_id, record in records(one).items() if record["status"] == "ok"]
    assert len(ran) >= 6, ran  # ddp, its twin, zero1, zero3, fsdp, fsdp1 (and deepspeed where installed)
    assert set(records(two)) == set(records(one))
    _same_as_one_node(records(one), records(two))
    assert "node 0 stored the results" in node1.stderr
    assert not (two / "node1").exists() or not any((two / "node1").iterdir())  # node 1 keeps nothing


@pytest.mark.heavy
def test_a_multi_node_run_records_every_node_and_is_its_own_machine(runs):
    (_, one), (_, two) = runs["one"], runs["two"]
    info = run_info(two)
    assert len(info["nodes"]) == 2
    for node in info["nodes"]:
        assert node["host"] and node["torch"] and "interconnect" in node
    single = RunInfo.model_validate(run_info(one))
    double = RunInfo.model_validate(info)
    assert single.nodes == []
    assert machine_fingerprint(single) != machine_fingerprint(double)  # a baseline from one node never gates two


@pytest.mark.heavy
def test_srun_gives_the_single_node_numbers(runs):
    (_, one), (srun, srun_dir) = runs["one"], runs["srun"]
    assert srun.returncode == 0, srun.stderr[-3000:]
    assert len(records(srun_dir)) == 3  # ddp, its twin, fsdp
    _same_as_one_node(records(one), records(srun_dir))
    (run,) = [p for p in srun_dir.iterdir() if (p / "run.json").exists()]
    assert not [p for p in run.iterdir() if p.name.startswith("zbench-")]  # the cases' shared directories are gone


@pytest.mark.heavy
def test_srun_names_the_rank_killed_by_a_signal(runs):
    result, results = runs["srun-kill"]
    assert result.returncode == 1, result.stderr[-3000:]
    got = {r["config"]["implementation"]: r for r in records(results).values() if not r["config"]["noise_twin"]}
    assert got[FAULTY]["status"] == "error"
    # the faulty engine kills rank 1; srun then stops rank 0 (also "Killed"), but said rank 1 first
    assert got[FAULTY]["error"] == "rank 1 killed by signal SIGKILL without a result", got[FAULTY]["error"]
    assert got["ddp"]["status"] == "ok"


@pytest.mark.heavy
def test_a_rank_killed_on_node_1_fails_its_case_by_name_and_the_suite_goes_on(tmp_path):
    suite = tmp_path / "kill.yaml"
    suite.write_text(KILL_SUITE)
    marker = tmp_path / "killed-rank"
    node0, node1 = two_nodes(str(suite), tmp_path / "results", node1_env={"ZBENCH_TEST_KILL_HERE": str(marker)})
    assert node0.returncode == 1, node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    killed = int(marker.read_text())
    got = {
        r["config"]["implementation"]: r
        for r in records(tmp_path / "results").values()
        if not r["config"]["noise_twin"]
    }
    faulty = got[FAULTY]
    assert faulty["status"] == "error"
    assert f"rank {killed} killed by signal SIGKILL without a result" in faulty["error"], faulty["error"]
    assert got["ddp"]["status"] == "ok" and got["torch_zero"]["status"] == "ok"  # before and after: intact, and on
    assert got["torch_zero"]["equivalence"]["equivalent"] is True


@pytest.mark.heavy
def test_a_node_that_never_comes_is_one_line_after_the_timeout(tmp_path):
    port = free_port()
    result = zbench(
        "run", str(ROOT / "suites" / "smoke.yaml"), "--nnodes", "2", "--node-rank", "0",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "3", "--results", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"rendezvous at 127.0.0.1:{port} timed out after 3 s: node rank(s) 1 of 2 did not join" in last
    assert "Traceback" not in result.stderr


BAD_FLAGS = [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2 is not a node of --nnodes 2"),
    (["--nnodes", "2", "--rdzv-endpoint", "nowhere"], "is not HOST:PORT"),
    (["--node-rank", "1"], "give --nnodes too"),
    (["--launcher", "slurm", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "takes its nodes from the allocation"),
    (["--set", "world_sizes=[3]", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "does not split evenly over 2"),
]


@pytest.mark.heavy
def test_bad_multi_node_flags_are_one_line(tmp_path):
    smoke = str(ROOT / "suites" / "smoke.yaml")
    results = zbench_many([["run", smoke, *flags, "--results", str(tmp_path)] for flags, _ in BAD_FLAGS])
    for result, (flags, message) in zip(results, BAD_FLAGS):
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (flags, result.stderr)


def test_srun_missing_is_one_line(tmp_path):
    env_path = os.environ["PATH"]
    os.environ["PATH"] = "/nonexistent"
    try:
        result = zbench("run", str(ROOT / "suites" / "smoke.yaml"), "--launcher", "slurm", "--results", str(tmp_path))
    finally:
        os.environ["PATH"] = env_path
    assert result.returncode == 2, result.stderr
    assert "--launcher slurm needs srun on PATH" in result.stderr


def test_fingerprint_of_one_node_is_unchanged_by_the_nodes_field():
    env = Environment(host="a", cpu_count=2, gpus=["H100"])
    one = RunInfo(run_id="r", suite=SuiteInfo(name="s"), environment=env)
    assert machine_fingerprint(one) == machine_fingerprint(one.model_copy(update={"nodes": [env]}))
    two = one.model_copy(update={"nodes": [env, env.model_copy(update={"host": "b"})]})
    swapped = one.model_copy(update={"nodes": [env.model_copy(update={"host": "b"}), env]})
    assert len({machine_fingerprint(one), machine_fingerprint(two), machine_fingerprint(swapped)}) == 3


def test_files_larger_than_a_store_message_reach_node_0_whole(tmp_path):
    """The final parameters of the 41M-parameter model are 164 MB; the store refuses one message over 8 MiB."""
    import datetime

    from torch.distributed import TCPStore

    from zbench.launch.elastic import Rendezvous
    from zbench.launch.handoff import CaseFiles
    from zbench.launch.nodes import CHUNK_BYTES, NodeGroup, NodeReport

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    rdzv = Rendezvous(endpoint=f"127.0.0.1:{server.port}", nnodes=2)
    leader, follower = NodeGroup(rdzv, server, []), NodeGroup(rdzv, client, [])
    params = tmp_path / "sent" / "params.pt"
    params.parent.mkdir()
    payload = os.urandom(5 * CHUNK_BYTES + 12345)  # 20 MiB and a ragged end
    params.write_bytes(payload)
    os.utime(params, ns=(1_000_000_000, 1_000_000_000))
    key = "zbench/case/1/from/1"
    report = NodeReport(node_rank=1, failures={1: -9}, files=[follower._send(params, f"{key}/file0")])
    client.set(key, report.model_dump_json())
    leader._seq = 1  # as if node 0 had announced case 1
    received = CaseFiles(tmp_path / "received")
    received.workdir.mkdir()
    merged = leader.collect(received, timeout_s=5)
    assert received.params.read_bytes() == payload
    assert received.params.stat().st_mtime_ns == 1_000_000_000  # the error files' order rests on their times
    assert merged.failures == {1: -9}
    assert not server.check([f"{key}/file0/0"])  # node 0 took the pieces out of the store
