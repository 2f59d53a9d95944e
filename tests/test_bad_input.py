"""Every kind of bad input is one line on stderr naming the problem, exit code 2, no traceback (real CLI runs)."""

from __future__ import annotations

import pytest

from tests.conftest import zbench_many

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

GOOD = "models: [tiny]\nimplementations: [ddp]\nworld_sizes: [2]\ndevice: cpu\n"
NVME = GOOD.replace("[ddp]", "[zero2]") + "offload: [nvme]\n"

# (test id, suite text or None for "no file", extra CLI args, text the one line must contain)
CASES = [
    ("missing-file", None, [], "suite file not found"),
    ("malformed-yaml", "models: [tiny\nimplementations: ddp\n", [], "malformed YAML"),
    ("not-a-mapping", "- just\n- a list\n", [], "must be a YAML mapping"),
    ("unknown-key", GOOD + "stepz: 3\n", [], "unknown key 'stepz'"),
    ("unknown-implementation", GOOD.replace("[ddp]", "[zero9]"), [], "unknown implementation 'zero9'"),
    ("bad-import-path", GOOD.replace("[ddp]", "['no_such_pkg.mod:Thing']"), [], "cannot import implementation"),
    ("unknown-model", GOOD.replace("[tiny]", "[huge]"), [], "unknown model 'huge'"),
    (
        "model-builder-bad-module",
        GOOD.replace("[tiny]", "['no_such_pkg.models:build']"),
        [],
        "cannot import 'no_such_pkg.models'",
    ),
    ("model-builder-malformed", GOOD.replace("[tiny]", "[':build']"), [], "expected a preset name or module:builder"),
    (
        "model-builder-not-callable",
        GOOD.replace("[tiny]", "['tests.plugins.user_models:NOT_CALLABLE']"),
        [],
        "has no callable 'NOT_CALLABLE'",
    ),
    (
        "model-builder-not-a-module",
        GOOD.replace("[tiny]", "['tests.plugins.user_models:not_a_module']"),
        [],
        "not a torch.nn.Module",
    ),
    (
        "model-builder-no-data-contract",
        GOOD.replace("[tiny]", "['tests.plugins.user_models:no_data_contract']"),
        [],
        "no int 'vocab_size'",
    ),
    (
        "model-builder-seq-len",
        GOOD.replace("[tiny]", "['tests.plugins.user_models:shared_blocks']") + "seq_len: 64\n",
        [],
        "max_seq_len 16",
    ),
    (
        "model-builder-no-blocks-to-checkpoint",
        GOOD.replace("[tiny]", "['tests.plugins.user_models:no_blocks']") + "activation_checkpointing: [true]\n",
        [],
        "has no .blocks",
    ),
    ("stage-out-of-range", GOOD.replace("[ddp]", "[{name: ddp, stages: [4]}]"), [], "stages.0"),
    ("stage-negative", GOOD.replace("[ddp]", "[{name: ddp, stages: [-1]}]"), [], "greater than or equal to 0"),
    ("world-size-zero", GOOD.replace("[2]", "[0]"), [], "world_sizes.0"),
    (
        "world-size-word",
        GOOD.replace("[2]", "[two]"),
        [],
        "world_sizes.0: a world size is a positive number of ranks, or auto",
    ),
    ("steps-zero", GOOD + "steps: 0\n", [], "steps"),
    ("bad-precision", GOOD + "precisions: [fp8]\n", [], "'fp32', 'bf16' or 'fp16'"),
    ("bad-device", GOOD.replace("device: cpu", "device: tpu"), [], "'auto', 'cpu' or 'cuda'"),
    ("missing-models", "implementations: [ddp]\nworld_sizes: [2]\n", [], "missing required key 'models'"),
    ("more-gpus-than-present", GOOD.replace("device: cpu", "device: cuda"), [], "cuda"),
    ("warmup-not-below-steps", GOOD + "steps: 3\nwarmup_steps: 3\n", [], "warmup_steps"),
    ("negative-timeout", GOOD + "timeout_s: -1\n", [], "timeout_s"),
    ("seq-len-too-long", GOOD + "seq_len: 4096\n", [], "exceeds model 'tiny'"),
    ("unknown-optimizer", GOOD + "optimizer: {name: lamb}\n", [], "'adamw' or 'sgd'"),
    ("negative-lr", GOOD + "optimizer: {lr: -0.1}\n", [], "optimizer.lr"),
    ("unknown-optimizer-key", GOOD + "optimizer: {lr: 0.1, beta: 3}\n", [], "unknown key 'optimizer.beta'"),
    ("micro-batch-zero", GOOD + "micro_batch: 0\n", [], "micro_batch"),
    ("bad-offload", GOOD + "offload: [disk]\n", [], "offload.0"),
    ("empty-file", "", [], "must be a YAML mapping"),
    ("steps-not-a-number", GOOD + "steps: many\n", [], "valid integer"),
    ("resume-unknown-run", GOOD, ["--resume", "nope"], "no such run"),
    ("results-not-a-directory", GOOD, ["--results", "/dev/null/x"], "not writable"),
    ("nvme-without-dir", NVME, [], "sets no nvme_dir"),
    ("nvme-dir-missing", NVME + "nvme_dir: /no/such/dir\n", [], "does not exist"),
    ("nvme-dir-a-file", NVME + "nvme_dir: /dev/null\n", [], "not a directory"),
    ("nvme-dir-not-writable", NVME + "nvme_dir: /proc\n", [], "not writable"),
    ("nvme-dir-too-small", NVME.replace("[tiny]", "[gpt-70b]") + "nvme_dir: /tmp\n", [], "GiB free"),
    ("profile-step-past-the-end", GOOD + "steps: 6\nprofile: {steps: [6]}\n", [], "profile.steps [6] outside"),
    ("profile-step-negative", GOOD + "profile: {steps: [-1]}\n", [], "profile.steps.0: input should be greater"),
    ("profile-no-steps", GOOD + "profile: {steps: []}\n", [], "profile.steps: list should have at least 1"),
    ("profile-unknown-key", GOOD + "profile: {steps: [5], every: 2}\n", [], "unknown key 'profile.every'"),
    (
        "profile-every-timed-step",
        GOOD + "steps: 4\nwarmup_steps: 2\nprofile: {steps: [2, 3]}\n",
        [],
        "leave no step to time",
    ),
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    invocations = []
    for name, text, extra, _ in CASES:
        path = tmp / f"{name}.yaml"
        if text is not None:
            path.write_text(text)
        results = [] if "--results" in extra else ["--results", str(tmp / "results")]
        invocations.append(["run", str(path), *results, *extra])
    invocations += [
        ["compare", "ddp", "torch_zero", "--gpus", "8"],
        ["compare", "ddp", "nope", "--device", "cpu"],
        ["compare", "ddp"],
        ["run"],
        ["frobnicate"],
        ["compare", "ddp", "fsdp", "--device", "cpu", "--model", "huge"],
        ["compare", "ddp", "fsdp", "--device", "cpu", "--steps", "0"],
        ["run", "x.yaml", "--bogus-flag"],
        ["plan", "--gpus", "8"],
        ["plan", "--model", "gpt-7x"],
        ["compare", "ddp", "fsdp", "--device", "cpu", "--precision", "fp16"],
        ["compare", "ddp", "zero1", "--device", "cpu", "--precision", "fp8"],
        ["report", "--results", "/no/such/results"],
        ["check", "--results", "/no/such/results"],
    ]
    results = zbench_many(invocations)
    return dict(
        zip(
            [c[0] for c in CASES]
            + [
                "gpus-8",
                "compare-unknown",
                "compare-missing-arg",
                "run-no-suite",
                "unknown-command",
                "compare-unknown-model",
                "compare-zero-steps",
                "unknown-flag",
                "plan-no-model",
                "plan-unknown-model",
                "compare-unsupported",
                "compare-bad-precision",
                "report-no-results",
                "check-no-results",
            ],
            results,
        )
    ), tmp


EXPECT = {c[0]: c[3] for c in CASES} | {
    "gpus-8": "cuda",
    "compare-unknown": "unknown implementation 'nope'",
    "compare-missing-arg": "Missing argument",
    "run-no-suite": "Missing argument",
    "unknown-command": "No such command",
    "compare-unknown-model": "unknown model 'huge'",
    "compare-zero-steps": "steps",
    "unknown-flag": "No such option",
    "plan-no-model": "exactly one of --model",
    "plan-unknown-model": "unknown model 'gpt-7x'",
    "compare-unsupported": "fsdp cannot run tiny at fp16",
    "compare-bad-precision": "'fp8' is not one of",
    "report-no-results": "no runs found",
    "check-no-results": "no runs found",
}


def test_the_table_is_big_enough():
    assert len(EXPECT) >= 25


@pytest.mark.parametrize("name", list(EXPECT))
def test_one_clear_line_and_exit_2(answers, name):
    results, _ = answers
    r = results[name]
    assert r.returncode == 2, (name, r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("zbench: error:")
    assert EXPECT[name].lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in r.stderr


def test_bad_input_writes_no_results(answers):
    _, tmp = answers
    assert not (tmp / "results").exists()
