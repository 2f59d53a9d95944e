"""The ``zbench`` application object and its entry point: exit codes 0 ok, 1 a check failed, 2 bad input.

Note: every command module registers itself on :data:`app` when imported
(``zbench.cli`` imports them all); this module knows none of them.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

import zbench
from zbench.errors import OneLineError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Benchmark and regression-test ZeRO implementations against DDP: "
    "loss equivalence, step time, memory, reports.",
)


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


def _is_click_usage_error(exc: Exception) -> bool:
    """Click's usage errors (typer vendors its own click, so they are recognised by shape: exit code 2 and a
    ``format_message``)."""
    return getattr(exc, "exit_code", None) == 2 and callable(getattr(exc, "format_message", None))


def main(argv: list[str] | None = None) -> None:
    """Entry point: click's own usage errors and ours both become one line and exit code 2."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="zbench", standalone_mode=False)
    except OneLineError as exc:
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
