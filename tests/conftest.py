"""Shared fixtures: the zbench CLI run as a real subprocess, and suite files written to tmp dirs."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CLIResult:
    returncode: int
    stdout: str
    stderr: str


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this checkout first on PYTHONPATH, the caller's path kept after it."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def zbench(*args: str, cwd: Path = ROOT, timeout: float = 600) -> CLIResult:
    """Run ``python -m zbench ARGS`` the way a user would (a fresh process, real files)."""
    env = child_env(COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "zbench", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return CLIResult(proc.returncode, proc.stdout, proc.stderr)


def zbench_many(arg_lists: list[list[str]], cwd: Path = ROOT, timeout: float = 300) -> list[CLIResult]:
    """Run several CLI invocations concurrently (each pays torch's import once; together they overlap)."""
    env = child_env(COLUMNS="200")
    procs = [subprocess.Popen([sys.executable, "-m", "zbench", *args], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
             for args in arg_lists]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(CLIResult(p.returncode, stdout, stderr))
    return out


@pytest.fixture(scope="session")
def cli():
    return zbench
