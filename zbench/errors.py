"""Errors the CLI turns into one line on stderr and an exit code, never a traceback."""


class OneLineError(Exception):
    """A failure the CLI reports in one line: exit code 1 (a check or a measurement failed; run it again)."""

    exit_code = 1


class UsageError(OneLineError):
    """Bad input from the user (a suite file, a flag, a missing device): exit code 2."""

    exit_code = 2
