"""Errors the CLI turns into one line on stderr and an exit code, never a traceback."""


class UsageError(Exception):
    """Bad input from the user (a suite file, a flag, a missing device): exit code 2."""

    exit_code = 2
