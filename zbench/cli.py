"""The ``zbench`` command line: parsing and exit codes only (0 ok, 1 a check failed, 2 bad input)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

import zbench
from zbench.errors import UsageError
from zbench.plan import DEFAULT_RESERVE
from zbench.values import OFFLOAD_MODES, Precision

if TYPE_CHECKING:
    from zbench.case import Case
    from zbench.elastic import Rendezvous
    from zbench.preflight import Suite
    from zbench.regress import CheckResult
    from zbench.runner import RunResult
    from zbench.simulate.cluster import Cluster

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Benchmark and regression-test ZeRO implementations against DDP: "
    "loss equivalence, step time, memory, reports.",
)

#: The precision ``plan`` and ``compare`` assume unless told: mixed precision, as ZeRO is used.
DEFAULT_PRECISION: Precision = "bf16"
DEFAULT_RESULTS = Path("results")

ResultsOpt = Annotated[
    Path | None,
    typer.Option(
        "--results",
        envvar="ZBENCH_RESULTS",
        show_default="results",
        help="Directory that holds one sub-directory per run.",
    ),
]
ResultsArg = Annotated[
    Path | None,
    typer.Argument(
        metavar="RESULTS",
        show_default=False,
        help="Same as --results: a results directory (its newest run) or one run's directory.",
    ),
]
ReportOpt = Annotated[Path, typer.Option("--report", help="Directory the HTML report (index.html) is written to.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
PrecisionOpt = Annotated[Precision, typer.Option(help="Training precision (bf16/fp16: mixed precision).")]
DeviceOpt = Annotated[Literal["auto", "cpu", "cuda"], typer.Option(help="auto: cuda where a GPU is present.")]


def _results(positional: Path | None, option: Path | None) -> Path:
    """The results directory from ``RESULTS`` or ``--results`` (or ``$ZBENCH_RESULTS``), which must agree."""
    if positional is not None and option is not None and positional != option:
        raise UsageError(f"results given twice: {positional} and --results {option} (or $ZBENCH_RESULTS); give one")
    return positional or option or DEFAULT_RESULTS


def _version(value: bool) -> None:
    if value:
        print(f"zbench {zbench.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Benchmark and regression-test ZeRO implementations against DDP: loss equivalence, step time, memory, reports."""


def _stdout() -> Console:
    from zbench.console import make_console

    return make_console(stderr=False)


@app.command()
def run(
    suite_file: Annotated[Path, typer.Argument(metavar="SUITE", help="Suite YAML file, e.g. suites/smoke.yaml.")],
    results: ResultsOpt = None,
    report: ReportOpt = Path("reports"),
    resume: Annotated[
        str | None, typer.Option(help="Run id under --results to complete: cases already stored are not run again.")
    ] = None,
    keep_params: Annotated[
        bool,
        typer.Option(
            "--keep-params",
            help="Keep every case's final parameters "
            "(params/<case>.pt); by default they are deleted once the verdict is stored.",
        ),
    ] = False,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Set a suite key as if the file said it; VALUE is YAML, a dotted KEY reaches into a mapping "
            "(--set world_sizes=[2] --set optimizer.lr=0.01). Repeatable.",
        ),
    ] = None,
    patterns: Annotated[
        list[str] | None,
        typer.Option(
            "-k",
            "--select",
            metavar="PATTERN",
            help="Run only the cases whose id contains PATTERN (or matches it, with * ? [ as a glob), with the DDP "
            "references they are judged against. Repeatable: a case named by any runs.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="List the cases that would run, each skip reason, and whether each case's predicted memory fits "
            "this machine (zbench plan's check); run nothing.",
        ),
    ] = False,
    nnodes: Annotated[
        int,
        typer.Option(
            "--nnodes",
            min=1,
            help="Nodes the run spans (torchrun's --nnodes). Start this same command on every node, each with its "
            "own --node-rank; a case's world size is split evenly over the nodes.",
        ),
    ] = 1,
    node_rank: Annotated[
        int,
        typer.Option(
            "--node-rank",
            min=0,
            help="This node's rank. Node 0 leads: it hosts the rendezvous, stores every result and writes the "
            "report; the other nodes only run their ranks of each case and keep nothing.",
        ),
    ] = 0,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            metavar="HOST:PORT",
            help="Where the nodes meet: node 0's address and a free port (c10d rendezvous). Needed with --nnodes > 1.",
        ),
    ] = None,
    rdzv_timeout: Annotated[
        float,
        typer.Option("--rdzv-timeout", min=1, help="Seconds to wait for every node to join before giving up."),
    ] = 600.0,
    launcher: Annotated[
        Literal["elastic", "slurm"],
        typer.Option(
            "--launcher",
            help="elastic: torch's elastic agent starts each case's ranks (with --nnodes, on every node). slurm: "
            "one srun step per case across the sbatch allocation's nodes; run zbench once, on the first node, "
            "with --results on a filesystem every node sees (docs/multi-node.md).",
        ),
    ] = "elastic",
) -> None:
    """Run every case of a suite, check each against DDP, store results and render the report.

    Exit code 1 when a case failed (error, oom, timeout) or did not train like DDP.
    """
    import dataclasses

    from zbench import elastic, preflight, selection
    from zbench import suite as suite_mod
    from zbench.console import Progress, stderr_console
    from zbench.launch import Launcher
    from zbench.report import render
    from zbench.runner import run_suite

    suite_file_ = suite_mod.read(suite_file, _key_values("--set", overrides or []))
    if keep_params:
        suite_file_ = suite_mod.SuiteFile(
            suite_file_.path, suite_file_.sha256, suite_file_.config.model_copy(update={"keep_params": True})
        )
    rdzv = elastic.rendezvous(nnodes, node_rank, rdzv_endpoint, rdzv_timeout)
    if launcher == "slurm" and rdzv.nnodes > 1:
        raise UsageError(
            "--launcher slurm takes its nodes from the allocation: drop --nnodes/--node-rank/--rdzv-endpoint"
        )
    if launcher == "slurm":
        from zbench.slurm import srun_binary

        srun_binary()  # before anything runs: without srun every case would fail the same way
    how = Launcher(kind=launcher)
    suite = preflight.prepare(suite_file_, nnodes=how.nnodes if launcher == "slurm" else rdzv.nnodes)
    suite = dataclasses.replace(suite, cases=selection.select(suite.cases, patterns or []))
    if dry_run:
        _print_dry_run(suite.cases, rdzv.nnodes)
        return
    root = _results(None, results)
    result = (
        run_suite(suite, results_root=root, resume=resume, progress=Progress(), launcher=how)
        if rdzv.nnodes == 1
        else _run_on_nodes(suite, rdzv, root, resume)
    )
    if result is None:  # a node other than 0: it stores nothing
        return
    page = render(result.run, report, results_root=root)
    err = stderr_console()
    err.print(Text(f"results: {result.run.path}\nreport:  {page}"))
    if result.failed:
        err.print(
            Text(
                f"{len(result.failed)} case(s) failed or diverged from DDP: "
                f"{', '.join(r.case_id for r in result.failed)}",
                style="red",
            )
        )
        raise typer.Exit(1)


def _run_on_nodes(suite: Suite, rdzv: Rendezvous, root: Path, resume: str | None) -> RunResult | None:
    """Meet the other nodes; node 0 runs the suite with them, the others follow it (``None``: nothing to report)."""
    from zbench import environment
    from zbench.console import Progress, stderr_console
    from zbench.launch import Launcher
    from zbench.nodes import NodeGroup
    from zbench.run_info import Environment
    from zbench.runner import run_suite

    err = stderr_console()
    err.print(Text(f"node {rdzv.node_rank} of {rdzv.nnodes}: waiting for every node at {rdzv.endpoint}"))
    here = Environment.model_validate(environment.collect())
    me = f"node {rdzv.node_rank}"
    with NodeGroup.join(rdzv, suite_sha256=suite.sha256 or "", environment=here) as nodes:
        if nodes.leader:
            return run_suite(
                suite, results_root=root, resume=resume, progress=Progress(), launcher=Launcher(nodes=nodes)
            )
        count = nodes.follow(on_case=lambda task, what: err.print(Text(f"{me}: {task.case.case_id} {what}")))
    err.print(Text(f"{me}: ran its ranks of {count} case(s); node 0 stored the results and wrote the report"))
    return None


def _print_dry_run(cases: tuple[Case, ...], nnodes: int) -> None:
    from zbench.dry_run import describe
    from zbench.formatting import fmt_bytes

    rows = describe(cases, nnodes)
    table = Table(title=f"{len(rows)} cases (memory per rank after {DEFAULT_RESERVE:.0%} kept free; nothing was run)")
    for col in ("case", "would", "model states + working set", "memory per rank", "fits?"):
        table.add_column(col, justify="left" if col in ("case", "would") else "right")
    for r in rows:
        would = f"skip: {r.case.skip_reason}" if r.case.skip_reason else "run"
        fits = {True: "yes", False: "NO", None: "-"}[r.fits]
        table.add_row(r.case.case_id, would, fmt_bytes(r.device_bytes), fmt_bytes(r.capacity_bytes), fits)
    _stdout().print(table)
    running = [r for r in rows if not r.case.skip_reason]
    too_big = [r.case.case_id for r in running if r.fits is False]
    summary = f"{len(running)} would run, {len(rows) - len(running)} skipped"
    _stdout().print(summary + (f"; {len(too_big)} predicted not to fit: {', '.join(too_big)}" if too_big else ""))


@app.command()
def compare(
    a: Annotated[str, typer.Argument(metavar="A", help="First implementation (name or module:attribute).")],
    b: Annotated[str, typer.Argument(metavar="B", help="Second implementation.")],
    gpus: Annotated[
        int | None, typer.Option(help="Run on this many GPUs (NCCL). Bad input if fewer are present.")
    ] = None,
    device: DeviceOpt = "auto",
    nproc: Annotated[
        int | None, typer.Option(help="Ranks (processes) when not using --gpus; default: all GPUs, or 2 on CPU.")
    ] = None,
    model: Annotated[str, typer.Option(help="Model preset (see `zbench list`).")] = "tiny",
    steps: Annotated[int, typer.Option(help="Training steps (first 3 are warm-up).")] = 20,
    micro_batch: Annotated[int, typer.Option(help="Sequences per rank per step.")] = 4,
    precision: PrecisionOpt = DEFAULT_PRECISION,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (with a `cases` list) instead of a table.")
    ] = False,
    results: ResultsOpt = None,
) -> None:
    """Run two implementations on the same model, data and seed and print them side by side (with DDP as reference).

    A combination either implementation does not support is bad input (exit 2), before anything trains.
    """
    from zbench import compare as compare_mod

    if gpus is not None:
        if nproc is not None or device not in ("auto", "cuda"):
            raise UsageError("--gpus runs on CUDA; do not combine it with --device cpu or --nproc")
        device, nproc = "cuda", gpus
    suite = compare_mod.prepare(
        a, b, device=device, nproc=nproc, model=model, steps=steps, micro_batch=micro_batch, precision=precision
    )
    outcome = compare_mod.run(suite, results=_results(None, results), quiet=as_json)
    if as_json:
        print(json.dumps(outcome.as_json(), indent=1))
    else:
        _stdout().print(outcome.table())
    if outcome.failed:
        raise typer.Exit(1)


@app.command()
def check(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    baseline: Annotated[
        list[str] | None,
        typer.Option(
            metavar="latest|DIR",
            help="'latest' (default: the newest earlier runs of the same suite on this machine), or a run "
            "directory, or a results directory (its newest runs of the suite); repeat to pool several.",
        ),
    ] = None,
    baseline_runs: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="N",
            help="How many earlier runs make the baseline (default: the suite's, else 5). With 3 or more, how far "
            "their medians spread widens each case's time allowance: the load's effect on that engine.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    markdown: Annotated[
        Path | None, typer.Option(help="Also write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY).")
    ] = None,
    time_threshold: Annotated[
        float | None, typer.Option(help="Minimum step-time growth in percent (default: the suite's, else 5).")
    ] = None,
    memory_threshold: Annotated[
        float | None, typer.Option(help="Minimum memory growth in percent (default: the suite's, else 2).")
    ] = None,
) -> None:
    """Gate a run against baseline runs from the same machine: exit 1 on any regression or failed case, else 0.

    The candidate is the newest run under RESULTS (or RESULTS itself when it is one run's directory). Each case's
    step time over DDP's is judged against the baseline runs' (docs/methods.md#regression-gate).
    """
    from zbench import check as check_mod

    outcome = check_mod.run(
        _results(results_arg, results),
        baseline or [],
        time_pct=time_threshold,
        memory_pct=memory_threshold,
        baseline_runs=baseline_runs,
    )
    _gate_output(outcome, markdown=markdown, as_json=as_json, title="zbench check")


def _gate_output(outcome: CheckResult, *, markdown: Path | None, as_json: bool, title: str) -> None:
    """Print (table or JSON) and append the Markdown verdict; exit 1 when the gate failed."""
    from zbench import check as check_mod

    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        with open(markdown, "a") as f:
            f.write(check_mod.markdown(outcome, title=title))
    if as_json:
        print(json.dumps(outcome.as_json(), indent=1))
    else:
        check_mod.print_text(outcome, _stdout())
    if outcome.failed:
        raise typer.Exit(1)


@app.command()
def ab(
    suite_file: Annotated[Path, typer.Argument(metavar="SUITE", help="Suite YAML file both sides run.")],
    base: Annotated[
        Path,
        typer.Option(
            help="A checkout of the base revision (e.g. `git worktree add ../base $BASE_SHA`); "
            "this installation is the head."
        ),
    ],
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved rounds: each runs the suite once per side.")] = 3,
    results: Annotated[
        Path, typer.Option(help="Where each side's runs are stored (<results>/base, <results>/head).")
    ] = Path("results-ab"),
    as_json: JsonOpt = False,
    markdown: Annotated[
        Path | None, typer.Option(help="Also write the Markdown verdict here (e.g. the PR comment's body).")
    ] = None,
    time_threshold: Annotated[
        float | None, typer.Option(help="Minimum growth of step time over DDP's, percent (default: the suite's).")
    ] = None,
    memory_threshold: Annotated[
        float | None, typer.Option(help="Minimum memory growth in percent (default: the suite's, else 2).")
    ] = None,
) -> None:
    """A/B for a pull request: base and head measured on this machine in alternating rounds, head gated on base.

    Each round runs SUITE once with the base checkout's code and once with this one's (the order alternates);
    each side's rounds are pooled per case and judged as `zbench check` judges two runs (step time relative
    to DDP in the same run, memory, status, equivalence). Exit 1 when head regressed or a head case failed.
    """
    from zbench import ab as ab_mod
    from zbench import preflight
    from zbench import suite as suite_mod
    from zbench.console import Progress
    from zbench.regress import thresholds_from

    suite = preflight.prepare(suite_mod.read(suite_file))
    thresholds = thresholds_from(
        suite.config.regression.model_dump(), time_pct=time_threshold, memory_pct=memory_threshold
    )
    outcome = ab_mod.run(
        suite, base=base, results=results, rounds=rounds, thresholds=thresholds, progress=Progress(quiet=as_json)
    )
    _gate_output(outcome, markdown=markdown, as_json=as_json, title="zbench A/B (base vs head)")


@app.command()
def plan(
    model: Annotated[str | None, typer.Option(help="Model preset (see `zbench list`).")] = None,
    params: Annotated[float | None, typer.Option(help="Parameter count instead of a preset, e.g. 7e9.")] = None,
    gpus: Annotated[int, typer.Option(help="Data-parallel GPUs (N in the formulas).")] = 8,
    gpu_memory: Annotated[
        float | None, typer.Option("--gpu-memory", help="GiB per GPU; shows which combinations fit.")
    ] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs sharing one host's memory (default: all).")] = None,
    precision: Annotated[
        Precision, typer.Option(help="bf16/fp16 (mixed: 2+2+12 bytes per parameter) or fp32 (4+4+8).")
    ] = DEFAULT_PRECISION,
    reserve: Annotated[
        float, typer.Option(help="Share of each GPU kept free for activations and buffers.")
    ] = DEFAULT_RESERVE,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace",
            help="Run each implementation's real code (build + 3 training steps) on fake tensors in a fake "
            "process group of --gpus ranks and report what rank 0 holds, next to the formulas. Needs --model.",
        ),
    ] = False,
    implementation: Annotated[
        list[str] | None,
        typer.Option(
            "--implementation",
            "-i",
            metavar="IMPL",
            help="With --trace: implementation to trace (repeatable; default: every built-in).",
        ),
    ] = None,
    offload: Annotated[
        list[str] | None,
        typer.Option(
            "--offload",
            "-o",
            metavar="MODE",
            help="With --trace: offload mode to trace (repeatable; default: every mode each supports).",
        ),
    ] = None,
    micro_batch: Annotated[int, typer.Option(help="With --trace: sequences per rank per step.")] = 1,
    seq_len: Annotated[
        int | None, typer.Option(help="With --trace: tokens per sequence (default: the model's).")
    ] = None,
    checkpointing: Annotated[
        bool, typer.Option("--checkpointing", help="With --trace: recompute each block's activations in backward.")
    ] = False,
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option",
            metavar="KEY=VALUE",
            help="With --trace: an implementation option, as a suite's `options:` (repeatable; VALUE is read as "
            "YAML), given to every traced implementation; e.g. nvme_chunk_mb=256 for the reference ZeRO engine's "
            "NVMe sub-groups. ddp, fsdp, fsdp1 and torch_zero take no options and ignore it.",
        ),
    ] = None,
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        typer.Option(
            help="With --trace: the fake tensors' device. auto: cuda where torch is built with CUDA (no GPU "
            "needed), else cpu (same bytes; the CPU paths of each implementation)."
        ),
    ] = "auto",
    simulate: Annotated[
        str | None,
        typer.Option(
            "--simulate",
            metavar="CLUSTER",
            help="Trace (as --trace does), then predict the step time, tokens/s per GPU, MFU and exposed "
            "communication on CLUSTER (a built-in profile: h100-sxm, a100-sxm, rtx4090-pcie, cpu-2core; or a "
            "YAML file) at every --scale.",
        ),
    ] = None,
    scale: Annotated[
        list[int] | None,
        typer.Option(help="With --simulate: world size to predict (repeatable; default 8 16 ... 1024)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Memory per GPU, per host and on disk for every ZeRO stage x offload mode, from the formulas, before running.

    With --trace, from the implementations' own code instead: model states by category and location, the peak
    of live tensor bytes and what it is made of, and the collectives of one step, per rank, at any scale.
    """
    from zbench import plan as plan_mod
    from zbench.formatting import fmt_bytes
    from zbench.presets import PRESETS

    if (model is None) == (params is None):
        raise UsageError("give exactly one of --model NAME or --params N")
    if model is not None and model not in PRESETS:
        raise UsageError(f"--model: unknown model {model!r}; allowed: {', '.join(PRESETS)}")
    if gpus < 1 or (params is not None and params < 1) or (gpu_memory is not None and gpu_memory <= 0):
        raise UsageError("--gpus, --params and --gpu-memory must be positive")
    if not 0 <= reserve < 1:
        raise UsageError(f"--reserve: {reserve} is not in [0, 1)")
    if option and not (trace or simulate):
        raise UsageError("--option applies to traced implementations: add --trace or --simulate")
    if trace or simulate:
        if model is None:
            raise UsageError("--trace and --simulate need --model (a preset: its shape is what runs)")
        _plan_trace(
            model,
            gpus=gpus,
            precision=precision,
            implementations=implementation,
            offloads=offload,
            micro_batch=micro_batch,
            seq_len=seq_len,
            checkpointing=checkpointing,
            options=_key_values("--option", option or []),
            device=device,
            gpu_memory=gpu_memory,
            gpus_per_node=gpus_per_node,
            as_json=as_json,
            simulate=simulate,
            scales=scale,
        )
        return
    cfg = PRESETS[model] if model else None
    n = cfg.num_parameters if cfg else int(params or 0)
    rows = plan_mod.plan(
        params=n,
        gpus=gpus,
        precision=precision,
        cfg=cfg,
        reserve=reserve,
        gpus_per_node=gpus_per_node,
        gpu_memory_bytes=gpu_memory * 2**30 if gpu_memory else None,
    )
    if as_json:
        print(
            json.dumps(
                plan_mod.as_json(
                    rows,
                    model=model,
                    parameters=n,
                    gpus=gpus,
                    precision=precision,
                    gpu_memory_gib=gpu_memory,
                    reserve=reserve,
                ),
                indent=1,
            )
        )
        return
    table = Table(
        title=f"{model or 'model'}: {n:,} parameters, {gpus} GPUs, {precision}"
        + (f", {gpu_memory:g} GiB per GPU ({reserve:.0%} kept for activations)" if gpu_memory else "")
    )
    for col in (
        "stage / offload",
        "per GPU",
        "  model states",
        "  stage-3 working set",
        "host per rank",
        "host per node",
        "disk per rank",
        "bytes/param on GPU",
        "fits",
    ):
        table.add_column(col, justify="right" if col != "stage / offload" else "left")
    for r in rows:
        table.add_row(
            r.name,
            fmt_bytes(r.device_bytes),
            fmt_bytes(r.model_state_device_bytes),
            fmt_bytes(r.working_set_bytes),
            fmt_bytes(r.host_bytes_per_rank),
            fmt_bytes(r.host_bytes_per_node),
            fmt_bytes(r.disk_bytes_per_rank),
            f"{r.model_state_device_bytes / n:.2f}",
            {True: "yes", False: "NO", None: "-"}[r.fits],
        )
    _stdout().print(table)


def _key_values(flag: str, items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs, each VALUE read as YAML (``256`` is a number, ``fp32`` a string)."""
    import yaml

    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag}: expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise UsageError(f"{flag}: {key.strip()}: not a YAML value: {value!r} ({exc.__class__.__name__})") from None
    return out


def _plan_trace(
    model: str,
    *,
    gpus: int,
    precision: Precision,
    implementations: list[str] | None,
    offloads: list[str] | None,
    micro_batch: int,
    seq_len: int | None,
    checkpointing: bool,
    options: dict[str, object],
    device: str,
    gpu_memory: float | None,
    gpus_per_node: int | None,
    as_json: bool,
    simulate: str | None = None,
    scales: list[int] | None = None,
) -> None:
    """``zbench plan --trace``: trace, then print the table (or JSON); with ``simulate``, the step-time sweep."""
    from zbench.formatting import fmt_bytes
    from zbench.implementations import BUILTIN
    from zbench.presets import PRESETS
    from zbench.trace import plan as trace_mod
    from zbench.trace.live import HELD

    names = implementations or list(BUILTIN)
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise UsageError(f"--implementation: unknown {', '.join(unknown)}; built-in: {', '.join(BUILTIN)}")
    seq = seq_len or PRESETS[model].seq
    if micro_batch < 1 or not 1 <= seq <= PRESETS[model].seq:
        raise UsageError(f"--micro-batch must be >= 1 and --seq-len in 1..{PRESETS[model].seq}")
    dev = trace_mod.default_device() if device == "auto" else device
    if dev == "cuda" and not trace_mod.cuda_traceable():
        raise UsageError("--device cuda: this torch is built without CUDA; trace with --device cpu")
    bad = [o for o in offloads or () if o not in OFFLOAD_MODES]
    if bad:
        raise UsageError(f"--offload: unknown {', '.join(bad)}; allowed: {', '.join(OFFLOAD_MODES)}")
    skipped = trace_mod.untraceable(names)
    if len(skipped) == len(set(names)):
        raise UsageError(f"--implementation: nothing to trace: {'; '.join(f'{n}: {r}' for n, r in skipped.items())}")
    for name, reason in skipped.items():
        print(f"{name}: not traced: {reason}", file=sys.stderr)
    combos = trace_mod.combinations(names, offloads or OFFLOAD_MODES, dev)
    if not combos:
        raise UsageError(f"nothing to trace: no implementation given runs the offload modes given on {dev}")
    for n, s, o in trace_mod.combinations(names, offloads or OFFLOAD_MODES):
        if (n, s, o) not in combos:
            print(f"{n} (stage {s}) + offload {o}: not traced, its offload needs another device than {dev}",
                  file=sys.stderr)  # fmt: skip
    cases = [
        trace_mod.make_case(
            model,
            n,
            s,
            o,
            gpus=gpus,
            precision=precision,
            micro_batch=micro_batch,
            seq_len=seq,
            device=dev,
            checkpointing=checkpointing,
            options=options,
        )
        for n, s, o in combos
    ]
    cluster = None
    if simulate is not None:
        from zbench.simulate.cluster import ClusterError, load

        try:
            cluster = load(simulate)
        except ClusterError as exc:
            raise UsageError(f"--simulate: {exc}") from None
        if any(n < 1 for n in scales or ()):
            raise UsageError("--scale: world sizes must be positive")
    rows = trace_mod.trace_plan(cases, device=dev, progress=None if as_json else trace_mod.stderr_progress)
    if cluster is not None:
        _print_simulation(rows, cluster, scales, as_json=as_json, model=model, gpus=gpus)
        return
    per_node = gpus_per_node or gpus
    limit = gpu_memory * 2**30 if gpu_memory else None
    if as_json:
        print(
            json.dumps(
                {
                    "model": model,
                    "gpus": gpus,
                    "precision": precision,
                    "device": dev,
                    "micro_batch": micro_batch,
                    "seq_len": seq,
                    "gpu_memory_gib": gpu_memory,
                    "gpus_per_node": per_node,
                    "rows": [r.to_json() for r in rows],
                },
                indent=1,
            )
        )
        return
    table = Table(
        title=f"{model} traced as rank 0 of {gpus} ({dev} fake tensors), {precision}, micro-batch {micro_batch} x "
        f"{seq} tokens" + (f", {gpu_memory:g} GiB per GPU" if gpu_memory else "")
    )
    for col in (
        "implementation",
        "states on GPU",
        "formula",
        "host per rank",
        "formula ",
        "disk",
        "peak on GPU",
        "largest share of the peak",
        "sent per step",
        "host per node",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("implementation", "largest share of the peak") else "right")
    notes = []
    for r in rows:
        if r.trace.error:
            table.add_row(r.name, "cannot trace", "", "", "", "", "", r.trace.error[:60], "", "", "-")
            notes.append(f"{r.name}: {r.trace.error}")
            continue
        roles = dict(r.trace.peak.get("device", {}).get("roles", {}))
        host_held = int(r.located("host")) if dev == "cpu" else 0  # the stand-in's host state, in the live peak
        if host_held and HELD in roles:
            roles[HELD] = max(0, roles[HELD] - host_held)
        top = max(roles, key=lambda role: roles[role]) if roles else "-"
        peak = r.peak("device") - host_held
        table.add_row(
            r.name,
            fmt_bytes(r.located("device")),
            fmt_bytes(r.located("device", "formula")),
            fmt_bytes(r.located("host")),
            fmt_bytes(r.located("host", "formula")),
            fmt_bytes(r.located("disk")),
            fmt_bytes(peak),
            f"{top} {roles.get(top, 0) / peak:.0%}" if peak else "-",
            fmt_bytes(r.trace.comm_bytes),
            fmt_bytes(r.located("host") * per_node),
            "-" if limit is None else ("yes" if peak <= limit else "NO"),
        )
        notes += [f"{r.name}: {line}" for line in r.differences]
    _stdout().print(table)
    err = Console(stderr=True, highlight=False)
    if dev == "cpu":
        err.print(
            Text(
                "traced on fake CPU tensors: 'GPU' is the compute device; host copies of offloaded state share "
                "its memory on this stand-in, so the peak shown is the live peak less the host-held state "
                "(host temporaries still count; docs/methods.md#tracing)"
            )
        )
    for line in notes:
        err.print(Text(line))


def _print_simulation(
    rows: list, cluster: Cluster, scales: list[int] | None, *, as_json: bool, model: str, gpus: int
) -> None:
    """The ``--simulate`` sweep: tokens/s per GPU at each world size, then the detail at ``--gpus``."""
    from zbench.simulate.sweep import DEFAULT_SCALES, simulate

    worlds = sorted(set(scales or DEFAULT_SCALES) | {gpus})
    sims = simulate(rows, cluster, worlds)
    if as_json:
        print(
            json.dumps({"model": model, "cluster": cluster.model_dump(), "rows": [r.to_json() for r in sims]}, indent=1)
        )
        return
    sweep = Table(title=f"{model} on {cluster.description or cluster.name}: predicted tokens/s per GPU")
    sweep.add_column("implementation")
    for w in worlds:
        sweep.add_column(f"{w} GPUs", justify="right")
    detail = Table(title=f"at {gpus} GPUs ({cluster.efficiency:.0%} of {cluster.peak_tflops:g} TFLOP/s assumed)")
    for col in ("implementation", "step", "compute", "exposed comm", "offload", "MFU", "comm / compute"):
        detail.add_column(col, justify="left" if col == "implementation" else "right")
    notes = []
    for sim in sims:
        if not sim.estimates:
            sweep.add_row(sim.name, *["cannot trace"] * len(worlds))
            continue
        sweep.add_row(sim.name, *[f"{e.tokens_per_s_per_gpu:,.0f}" for e in sim.estimates])
        e = next(e for e in sim.estimates if e.world == gpus)
        detail.add_row(
            sim.name, f"{e.step_s * 1e3:,.0f} ms", f"{e.compute_s * 1e3:,.0f} ms", f"{e.exposed_comm_s * 1e3:,.0f} ms",
            f"{e.offload_s * 1e3:,.0f} ms", f"{e.mfu:.0%}", f"{e.comm_to_compute:.2f}",
        )  # fmt: skip
        stop = sim.first_exposed()
        if stop is not None and cluster.overlap > 0:
            notes.append(f"{sim.name}: communication stops hiding behind compute at {stop} GPUs")
    if cluster.overlap == 0:
        notes.append(f"{cluster.name}: overlap 0, so no communication is assumed hidden behind compute")
    out = _stdout()
    out.print(sweep)
    out.print(detail)
    for line in notes:
        out.print(Text(line))


@app.command("report")
def report_cmd(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    report: ReportOpt = Path("reports"),
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="First trace every case of the run on fake tensors and predict its step time with the simulator "
            "(compute from the DDP reference's measured phases, communication alpha-beta at the run's probed "
            "bandwidth); stored as <run>/simulation.json and shown in the report beside the measured times.",
        ),
    ] = False,
    price_per_gpu_hour: Annotated[
        float | None,
        typer.Option(
            help="Show each case's cost per step and per million tokens at this price of one GPU (one rank) per "
            "hour, instead of the suite's price_per_gpu_hour.",
        ),
    ] = None,
) -> None:
    """Re-render the HTML report from stored results: the newest run under RESULTS, with trends over earlier runs."""
    from zbench.report import render
    from zbench.store import latest_run

    if price_per_gpu_hour is not None and not price_per_gpu_hour > 0:
        raise UsageError(f"--price-per-gpu-hour must be positive, got {price_per_gpu_hour:g}")
    root = _results(results_arg, results)
    run = latest_run(root)
    if run is None:
        raise UsageError(f"{root}: no runs found (expected <dir>/<run-id>/run.json)")
    err = Console(stderr=True, highlight=False)
    if simulate:
        from zbench.simulate.measured import simulate_run

        sim = simulate_run(run, progress=lambda line: err.print(Text(line)))
        worst = f"{sim.worst_abs_error:.0%}" if sim.worst_abs_error is not None else "-"
        median = f"{sim.median_abs_error:.0%}" if sim.median_abs_error is not None else "-"
        err.print(Text(f"simulated {len(sim.predictions)} cases: |error| median {median}, worst {worst}"))
    page = render(run, report, results_root=root, price_per_gpu_hour=price_per_gpu_hour)
    err.print(Text(f"report: {page} (run {run.run_id})"))


@app.command("list")
def list_cmd(
    suites: Annotated[Path, typer.Option(help="Where to look for suite files.")] = Path("suites"),
) -> None:
    """Implementations, model presets and suites zbench knows."""
    from zbench import registry
    from zbench.implementations import BUILTIN
    from zbench.presets import PRESETS

    out = _stdout()
    impls = Table(title="implementations")
    for col in ("name", "stages", "precisions", "offload", "source"):
        impls.add_column(col)
    for name, target in BUILTIN.items():
        try:
            caps = registry.resolve(name).capabilities
            impls.add_row(
                name,
                ",".join(map(str, sorted(caps.stages))),
                ",".join(sorted(caps.precisions)),
                ",".join(sorted(caps.offload)),
                target,
            )
        except LookupError as exc:
            impls.add_row(name, "-", "-", "-", f"unavailable: {exc}")
    out.print(impls)
    out.print("Your own: name it in a suite as 'package.module:attribute' (see zbench.protocol).\n")
    models = Table(title="models")
    for col in ("name", "parameters", "layers", "d_model", "heads", "vocab", "seq"):
        models.add_column(col)
    for name, cfg in PRESETS.items():
        models.add_row(
            name,
            f"{cfg.num_parameters:,}",
            str(cfg.layers),
            str(cfg.d_model),
            str(cfg.heads),
            str(cfg.vocab),
            str(cfg.seq),
        )
    out.print(models)
    table = Table(title=f"suites in {suites}/")
    table.add_column("file")
    table.add_column("description")
    for path in sorted(suites.glob("*.yaml")) if suites.is_dir() else []:
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
            desc = data.get("description", "") if isinstance(data, dict) else ""
        except yaml.YAMLError:
            desc = "(malformed YAML)"
        table.add_row(str(path), str(desc).strip())
    out.print(table)


@app.command("gc")
def gc_cmd(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    keep: Annotated[int, typer.Option(min=1, help="Runs of each suite to keep (the newest).")] = 10,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
) -> None:
    """Delete old runs: keep the newest --keep runs of each suite under RESULTS; a run being written is kept."""
    from zbench import gc
    from zbench.formatting import fmt_bytes

    root = _results(results_arg, results)
    if not root.is_dir():
        raise UsageError(f"{root}: not a results directory")
    removed = gc.prune(root, keep=keep, dry_run=dry_run)
    err = Console(stderr=True, highlight=False)
    for run, size in removed:
        err.print(Text(f"{'would remove' if dry_run else 'removed'} {run.path} ({fmt_bytes(size)})"))
    total = sum(size for _, size in removed)
    err.print(
        Text(
            f"{len(removed)} run(s), {fmt_bytes(total)} {'to free' if dry_run else 'freed'}; "
            f"kept the newest {keep} of each suite"
        )
    )


@app.command("export")
def export_cmd(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            metavar="csv|parquet|tensorboard",
            help="csv or parquet: two tidy tables, cases.<ext> (one row per run and case) and steps.<ext> (one "
            "row per run, case and step); tensorboard: event files, one TensorBoard run per case "
            "(<out>/<run-id>/<case-id>). parquet and tensorboard need the 'export' extra.",
        ),
    ] = "csv",
    out: Annotated[Path, typer.Option("--out", help="Directory the export is written to.")] = Path("export"),
) -> None:
    """Export every run under RESULTS (or one run's directory) as CSV, Parquet or TensorBoard event files."""
    from zbench.export import FORMATS, export

    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    root = _results(results_arg, results)
    err = Console(stderr=True, highlight=False)
    paths = export(root, out, fmt, progress=lambda line: err.print(Text(line)))
    err.print(Text(f"exported {len(paths)} {'runs' if fmt == 'tensorboard' else 'tables'} to {out}"))


@app.command("env")
def env_cmd(as_json: JsonOpt = False) -> None:
    """What zbench sees: versions, distributed backends, GPUs, driver, nvml."""
    from zbench import environment

    info = environment.collect()
    if as_json:
        print(json.dumps(info, indent=1))
        return
    out = _stdout()
    for key, value in info.items():
        out.print(Text(f"{key}: ", style="bold") + Text(str(value)))


def _is_click_usage_error(exc: Exception) -> bool:
    """Click's usage errors (typer vendors its own click, so they are recognised by shape: exit code 2 and a
    ``format_message``)."""
    return getattr(exc, "exit_code", None) == 2 and callable(getattr(exc, "format_message", None))


def main(argv: list[str] | None = None) -> None:
    """Entry point: click's own usage errors and ours both become one line and exit code 2."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="zbench", standalone_mode=False)
    except UsageError as exc:
        print(f"zbench: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print(
            "zbench: interrupted; every case that finished is stored (complete the run with --resume RUN_ID)",
            file=sys.stderr,
        )
        sys.exit(130)
    except typer.Abort:
        print("zbench: aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:
        if not _is_click_usage_error(exc):
            raise
        ctx = getattr(exc, "ctx", None)
        hint = (
            f" (see 'zbench {ctx.info_name} --help')" if ctx and ctx.info_name != "zbench" else " (see 'zbench --help')"
        )
        print(f"zbench: error: {exc.format_message()}{hint}", file=sys.stderr)  # type: ignore[attr-defined]
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
