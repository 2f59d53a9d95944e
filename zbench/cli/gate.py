"""The regression gate's commands: ``zbench check`` (a run against earlier runs) and ``zbench ab`` (a PR's
base against its head, measured here in alternating rounds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zbench.cli.options import JsonOpt, MarkdownOpt, MemoryThresholdOpt, ResultsArg, ResultsOpt, results_dir, stdout

if TYPE_CHECKING:
    from zbench.verdicts.regress import CheckResult

BaselineOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="latest|DIR",
        help="'latest' (default: the newest earlier runs of the same suite on this machine), or a run "
        "directory, or a results directory (its newest runs of the suite); repeat to pool several.",
    ),
]
BaselineRunsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        metavar="N",
        help="How many earlier runs make the baseline (default: the suite's, else 5). With 3 or more, how far "
        "their medians spread widens each case's time allowance: the load's effect on that engine.",
    ),
]
BaseOpt = Annotated[
    Path,
    typer.Option(
        help="A checkout of the base revision (e.g. `git worktree add ../base $BASE_SHA`); "
        "this installation is the head."
    ),
]
AbResultsOpt = Annotated[Path, typer.Option(help="Where each side's runs are stored (<results>/base, <results>/head).")]


def check(
    results_arg: ResultsArg = None,
    results: ResultsOpt = None,
    baseline: BaselineOpt = None,
    baseline_runs: BaselineRunsOpt = None,
    as_json: JsonOpt = False,
    markdown: MarkdownOpt = None,
    time_threshold: Annotated[
        float | None, typer.Option(help="Minimum step-time growth in percent (default: the suite's, else 5).")
    ] = None,
    memory_threshold: MemoryThresholdOpt = None,
) -> None:
    """Gate a run against baseline runs from the same machine: exit 1 on any regression or failed case, else 0.

    The candidate is the newest run under RESULTS (or RESULTS itself when it is one run's directory). Each case's
    step time over DDP's is judged against the baseline runs' (docs/methods.md#regression-gate).
    """
    from zbench.verdicts import check as check_mod

    outcome = check_mod.run(
        results_dir(results_arg, results),
        baseline or [],
        time_pct=time_threshold,
        memory_pct=memory_threshold,
        baseline_runs=baseline_runs,
    )
    _gate_output(outcome, markdown=markdown, as_json=as_json, title="zbench check")


def ab(
    suite_file: Annotated[Path, typer.Argument(metavar="SUITE", help="Suite YAML file both sides run.")],
    base: BaseOpt,
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved rounds: each runs the suite once per side.")] = 3,
    results: AbResultsOpt = Path("results-ab"),
    as_json: JsonOpt = False,
    markdown: Annotated[
        Path | None, typer.Option(help="Also write the Markdown verdict here (e.g. the PR comment's body).")
    ] = None,
    time_threshold: Annotated[
        float | None, typer.Option(help="Minimum growth of step time over DDP's, percent (default: the suite's).")
    ] = None,
    memory_threshold: MemoryThresholdOpt = None,
) -> None:
    """A/B for a pull request: base and head measured on this machine in alternating rounds, head gated on base.

    Each round runs SUITE once with the base checkout's code and once with this one's (the order alternates);
    each side's rounds are pooled per case and judged as `zbench check` judges two runs (step time relative
    to DDP in the same run, memory, status, equivalence). Exit 1 when head regressed or a head case failed.
    """
    from zbench.run import ab as ab_mod
    from zbench.run.console import Progress
    from zbench.suite import config, preflight
    from zbench.verdicts.regress import thresholds_from

    suite = preflight.prepare(config.read(suite_file))
    thresholds = thresholds_from(
        suite.config.regression.model_dump(), time_pct=time_threshold, memory_pct=memory_threshold
    )
    outcome = ab_mod.run(
        suite, base=base, results=results, rounds=rounds, thresholds=thresholds, progress=Progress(quiet=as_json)
    )
    _gate_output(outcome, markdown=markdown, as_json=as_json, title="zbench A/B (base vs head)")


def _gate_output(outcome: CheckResult, *, markdown: Path | None, as_json: bool, title: str) -> None:
    """Print (table or JSON) and append the Markdown verdict; exit 1 when the gate failed."""
    from zbench.verdicts import check as check_mod

    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        with open(markdown, "a") as f:
            f.write(check_mod.markdown(outcome, title=title))
    if as_json:
        print(json.dumps(outcome.as_json(), indent=1))
    else:
        check_mod.print_text(outcome, stdout())
    if outcome.failed:
        raise typer.Exit(1)
