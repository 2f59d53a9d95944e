"""Ranks forked from a warm process that has already imported torch, instead of started as fresh interpreters.

Why: a rank started as ``python -m zbench.worker`` spends most of a short case importing: torch itself, then
``torch._dynamo``, which DDP's constructor imports to read one setting. Profiled on the 2-core CPU machine on
2026-11-28 (torch 2.13), a two-rank DDP case of the tiny model took 5.5 s, of which each rank spent about 3.5 s
in imports and 0.7 s building and training. Python's fork server imports them once per harness, and each rank is
a fork of it: the heavy test tier, hundreds of such cases, and a user's suite of many small cases run several
times faster.

What stays the same: the elastic agent starts, numbers, watches and stops the ranks as before (its
``forkserver`` start method runs a function, ``zbench.rank.worker.forked``, in place of the command line); each
rank has its own process, process group, log, result file and exit code. The fork server is a fresh interpreter
that imports modules and never runs a tensor operation, so no thread pool, CUDA context or allocator state is
inherited.

Ranks start as fresh interpreters (``python -m zbench.worker``) instead when:

- ``ZBENCH_FORK_RANKS=0`` is set (to rule the fork server out when something looks wrong);
- they must import another checkout (``zbench ab``'s base: :func:`fresh_interpreters`);
- the fork server already runs with another environment than this case's ranks need. Python keeps one fork
  server per process and its environment is fixed when it starts: CPU ranks get glibc's mmap threshold
  (``zbench.measure.memory.CPU_MALLOC_ENV``), which glibc reads once, at start-up; GPU ranks do not;
- the platform is not Linux.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib import import_module

from zbench.measure.memory import CPU_MALLOC_ENV

#: The rank's code, named as the command line names it (``python -m zbench.worker``): the launcher sits below it.
RANK_MODULE = "zbench.rank.worker"
#: What the fork server imports before it forks any rank: the rank's own code, and what DDP imports lazily.
PRELOAD = (RANK_MODULE, "torch._dynamo")
#: Set to 0 to start every rank as a fresh interpreter.
FORK_RANKS_VAR = "ZBENCH_FORK_RANKS"

_server_env: dict[str, str] | None = None
_fresh_depth = 0


def rank_env(device: str) -> dict[str, str]:
    """What a rank on ``device`` needs in its environment from the start, less what the user exported already."""
    return {k: v for k, v in CPU_MALLOC_ENV.items() if k not in os.environ} if device == "cpu" else {}


@contextmanager
def fresh_interpreters() -> Iterator[None]:
    """Ranks launched inside start as fresh interpreters (they import code the harness has not: ``zbench ab``)."""
    global _fresh_depth
    _fresh_depth += 1
    try:
        yield
    finally:
        _fresh_depth -= 1


def can_fork(device: str) -> bool:
    """Whether this case's ranks may be forked from the fork server, which this starts on first use."""
    global _server_env
    if _fresh_depth or os.environ.get(FORK_RANKS_VAR, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    env = rank_env(device)
    if _server_env is None:
        with _environment(env):
            multiprocessing.set_forkserver_preload(list(PRELOAD))
            multiprocessing.forkserver.ensure_running()
        _server_env = env
    return _server_env == env


def forked_rank(workdir: str, search_path: list[str]) -> int:
    """What the agent runs in each forked rank: ``zbench.rank.worker.forked`` (already imported there)."""
    entry: Callable[[str, list[str]], int] = import_module(RANK_MODULE).forked
    return entry(workdir, search_path)


def search_path() -> list[str]:
    """Where a forked rank looks for modules first, as a fresh one would: the user's PYTHONPATH, then the working
    directory (where suites' plug-in implementations usually live)."""
    return [p for p in (*os.environ.get("PYTHONPATH", "").split(os.pathsep), os.getcwd()) if p]


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment meanwhile (the fork server inherits it as it starts)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
