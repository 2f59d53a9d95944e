"""``zbench compare A B``: two implementations on one model, side by side, with DDP as the reference."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from zbench.cli.options import DEFAULT_PRECISION, DeviceOpt, PrecisionOpt, ResultsOpt, results_dir, stdout
from zbench.errors import UsageError

GpusOpt = Annotated[int | None, typer.Option(help="Run on this many GPUs (NCCL). Bad input if fewer are present.")]
NprocOpt = Annotated[
    int | None, typer.Option(help="Ranks (processes) when not using --gpus; default: all GPUs, or 2 on CPU.")
]
CompareJsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object (with a `cases` list) instead of a table.")
]


def compare(
    a: Annotated[str, typer.Argument(metavar="A", help="First implementation (name or module:attribute).")],
    b: Annotated[str, typer.Argument(metavar="B", help="Second implementation.")],
    gpus: GpusOpt = None,
    device: DeviceOpt = "auto",
    nproc: NprocOpt = None,
    model: Annotated[str, typer.Option(help="Model preset (see `zbench list`).")] = "tiny",
    steps: Annotated[int, typer.Option(help="Training steps (first 3 are warm-up).")] = 20,
    micro_batch: Annotated[int, typer.Option(help="Sequences per rank per step.")] = 4,
    precision: PrecisionOpt = DEFAULT_PRECISION,
    as_json: CompareJsonOpt = False,
    results: ResultsOpt = None,
) -> None:
    """Run two implementations on the same model, data and seed and print them side by side (with DDP as reference).

    A combination either implementation does not support is bad input (exit 2), before anything trains.
    """
    from zbench.run import compare as compare_mod

    if gpus is not None:
        if nproc is not None or device not in ("auto", "cuda"):
            raise UsageError("--gpus runs on CUDA; do not combine it with --device cpu or --nproc")
        device, nproc = "cuda", gpus
    suite = compare_mod.prepare(
        a, b, device=device, nproc=nproc, model=model, steps=steps, micro_batch=micro_batch, precision=precision
    )
    outcome = compare_mod.run(suite, results=results_dir(None, results), quiet=as_json)
    if as_json:
        print(json.dumps(outcome.as_json(), indent=1))
    else:
        stdout().print(outcome.table())
    if outcome.failed:
        raise typer.Exit(1)
