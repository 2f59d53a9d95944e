"""``zbench run SUITE``: every case of a suite, on one node or several, checked against DDP, stored, reported."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.table import Table
from rich.text import Text

from zbench.cli.options import ReportOpt, ResultsOpt, key_values, results_dir, stdout
from zbench.errors import UsageError
from zbench.plan.memory import DEFAULT_RESERVE

if TYPE_CHECKING:
    from zbench.cases.case import Case
    from zbench.launch.elastic import Rendezvous
    from zbench.launch.launcher import Launcher
    from zbench.run.runner import RunResult
    from zbench.suite.config import SuiteFile
    from zbench.suite.preflight import Suite

SuiteArg = Annotated[Path, typer.Argument(metavar="SUITE", help="Suite YAML file, e.g. suites/smoke.yaml.")]
ResumeOpt = Annotated[
    str | None, typer.Option(help="Run id under --results to complete: cases already stored are not run again.")
]
KeepParamsOpt = Annotated[
    bool,
    typer.Option(
        "--keep-params",
        help="Keep every case's final parameters "
        "(params/<case>.pt); by default they are deleted once the verdict is stored.",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Set a suite key as if the file said it; VALUE is YAML, a dotted KEY reaches into a mapping "
        "(--set world_sizes=[2] --set optimizer.lr=0.01). Repeatable.",
    ),
]
SelectOpt = Annotated[
    list[str] | None,
    typer.Option(
        "-k",
        "--select",
        metavar="PATTERN",
        help="Run only the cases whose id contains PATTERN (or matches it, with * ? [ as a glob), with the DDP "
        "references they are judged against. Repeatable: a case named by any runs.",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="List the cases that would run, each skip reason, and whether each case's predicted memory fits "
        "this machine (zbench plan's check); run nothing.",
    ),
]
NnodesOpt = Annotated[
    int,
    typer.Option(
        "--nnodes",
        min=1,
        help="Nodes the run spans (torchrun's --nnodes). Start this same command on every node, each with its "
        "own --node-rank; a case's world size is split evenly over the nodes.",
    ),
]
NodeRankOpt = Annotated[
    int,
    typer.Option(
        "--node-rank",
        min=0,
        help="This node's rank. Node 0 leads: it hosts the rendezvous, stores every result and writes the "
        "report; the other nodes only run their ranks of each case and keep nothing.",
    ),
]
EndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Where the nodes meet: node 0's address and a free port (c10d rendezvous). Needed with --nnodes > 1.",
    ),
]
RdzvTimeoutOpt = Annotated[
    float, typer.Option("--rdzv-timeout", min=1, help="Seconds to wait for every node to join before giving up.")
]
LauncherOpt = Annotated[
    Literal["elastic", "slurm"],
    typer.Option(
        "--launcher",
        help="elastic: torch's elastic agent starts each case's ranks (with --nnodes, on every node). slurm: "
        "one srun step per case across the sbatch allocation's nodes; run zbench once, on the first node, "
        "with --results on a filesystem every node sees (docs/multi-node.md).",
    ),
]


def run(
    suite_file: SuiteArg,
    results: ResultsOpt = None,
    report: ReportOpt = Path("reports"),
    resume: ResumeOpt = None,
    keep_params: KeepParamsOpt = False,
    overrides: SetOpt = None,
    patterns: SelectOpt = None,
    dry_run: DryRunOpt = False,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: EndpointOpt = None,
    rdzv_timeout: RdzvTimeoutOpt = 600.0,
    launcher: LauncherOpt = "elastic",
) -> None:
    """Run every case of a suite, check each against DDP, store results and render the report.

    Exit code 1 when a case failed (error, oom, timeout) or did not train like DDP.
    """
    read = _read(suite_file, overrides or [], keep_params)  # a bad file is one line before torch is imported
    from zbench.launch import elastic
    from zbench.report import render
    from zbench.run.console import Progress, stderr_console
    from zbench.run.runner import run_suite

    rdzv = elastic.rendezvous(nnodes, node_rank, rdzv_endpoint, rdzv_timeout)
    how = _launcher(launcher, rdzv)
    suite = _expand(read, patterns or [], nnodes=how.nnodes * rdzv.nnodes)
    if dry_run:
        _print_dry_run(suite.cases, rdzv.nnodes)
        return
    root = results_dir(None, results)
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
        failed = ", ".join(r.case_id for r in result.failed)
        err.print(Text(f"{len(result.failed)} case(s) failed or diverged from DDP: {failed}", style="red"))
        raise typer.Exit(1)


def _launcher(kind: Literal["elastic", "slurm"], rdzv: Rendezvous) -> Launcher:
    """How each case's ranks start; with ``srun``, checked before anything runs (else every case fails alike)."""
    from zbench.launch.launcher import Launcher

    if kind == "slurm":
        if rdzv.nnodes > 1:
            raise UsageError(
                "--launcher slurm takes its nodes from the allocation: drop --nnodes/--node-rank/--rdzv-endpoint"
            )
        from zbench.launch.slurm import srun_binary

        srun_binary()
    return Launcher(kind=kind)


def _read(path: Path, overrides: list[str], keep_params: bool) -> SuiteFile:
    """The suite file with ``--set`` (and ``--keep-params``) applied, validated."""
    from zbench.suite import config

    suite_file = config.read(path, key_values("--set", overrides))
    if keep_params:
        suite_file = config.SuiteFile(
            suite_file.path, suite_file.sha256, suite_file.config.model_copy(update={"keep_params": True})
        )
    return suite_file


def _expand(suite_file: SuiteFile, patterns: list[str], *, nnodes: int) -> Suite:
    """The suite expanded into cases for ``nnodes`` nodes (pre-flight checks included), ``-k`` selected."""
    import dataclasses

    from zbench.suite import preflight, selection

    suite = preflight.prepare(suite_file, nnodes=nnodes)
    return dataclasses.replace(suite, cases=selection.select(suite.cases, patterns))


def _run_on_nodes(suite: Suite, rdzv: Rendezvous, root: Path, resume: str | None) -> RunResult | None:
    """Meet the other nodes; node 0 runs the suite with them, the others follow it (``None``: nothing to report)."""
    from zbench.launch.launcher import Launcher
    from zbench.launch.nodes import NodeGroup
    from zbench.results.run_info import Environment
    from zbench.run import environment
    from zbench.run.console import Progress, stderr_console
    from zbench.run.runner import run_suite

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
    from zbench.results.formatting import fmt_bytes
    from zbench.run.dry_run import describe

    rows = describe(cases, nnodes)
    table = Table(title=f"{len(rows)} cases (memory per rank after {DEFAULT_RESERVE:.0%} kept free; nothing was run)")
    for col in ("case", "would", "model states + working set", "memory per rank", "fits?"):
        table.add_column(col, justify="left" if col in ("case", "would") else "right")
    for r in rows:
        would = f"skip: {r.case.skip_reason}" if r.case.skip_reason else "run"
        fits = {True: "yes", False: "NO", None: "-"}[r.fits]
        table.add_row(r.case.case_id, would, fmt_bytes(r.device_bytes), fmt_bytes(r.capacity_bytes), fits)
    out = stdout()
    out.print(table)
    running = [r for r in rows if not r.case.skip_reason]
    too_big = [r.case.case_id for r in running if r.fits is False]
    summary = f"{len(running)} would run, {len(rows) - len(running)} skipped"
    out.print(summary + (f"; {len(too_big)} predicted not to fit: {', '.join(too_big)}" if too_big else ""))
