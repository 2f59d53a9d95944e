"""What several commands share: the options they spell alike, and the helpers that read them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console

from zbench.errors import UsageError
from zbench.values import Precision

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
MarkdownOpt = Annotated[
    Path | None, typer.Option(help="Also write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY).")
]
MemoryThresholdOpt = Annotated[
    float | None, typer.Option(help="Minimum memory growth in percent (default: the suite's, else 2).")
]


def results_dir(positional: Path | None, option: Path | None) -> Path:
    """The results directory from ``RESULTS`` or ``--results`` (or ``$ZBENCH_RESULTS``), which must agree."""
    if positional is not None and option is not None and positional != option:
        raise UsageError(f"results given twice: {positional} and --results {option} (or $ZBENCH_RESULTS); give one")
    return positional or option or DEFAULT_RESULTS


def key_values(flag: str, items: list[str]) -> dict[str, object]:
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


def stdout() -> Console:
    """Tables and summaries go to stdout (stderr carries progress and notes)."""
    from zbench.run.console import make_console

    return make_console(stderr=False)


def stderr() -> Console:
    return Console(stderr=True, highlight=False)
