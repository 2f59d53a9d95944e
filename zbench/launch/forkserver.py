"""Ranks forked from a warm process that has already imported torch, instead of started as fresh interpreters.

Why: a rank started as ``python -m zbench.worker`` spends most of a short case importing: torch itself, then
``torch._dynamo``, which DDP's constructor imports to read one setting. Profiled on the 2-core CPU machine on
2026-11-28 (torch 2.13), a two-rank DDP case of the tiny model took 5.5 s, of which each rank spent about 3.5 s
in imports and 0.7 s building and training. Python's fork server imports them once per harness, and each rank is
a fork of it: a suite of five such cases took half the wall time (docs/methods.md#forked-ranks), and the heavy
test tier, hundreds of them, much less.

What stays the same: the elastic agent starts, numbers, watches and stops the ranks as before (its
``forkserver`` start method runs a function, :func:`forked_rank`, in place of the command line); each
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
"""The ranks' own variables (``rank_env``) the fork server started with (None: not started)."""
_server_start_env: dict[str, str] = {}
"""The whole environment the fork server started with."""
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
        with environment(env):
            multiprocessing.set_forkserver_preload(list(PRELOAD))
            multiprocessing.forkserver.ensure_running()
            _server_start_env.update(os.environ)
        _server_env = env
    return _server_env == env


def rank_arguments(workdir: str, device: str) -> list[object]:
    """What :func:`forked_rank` is given: the case's directory, where to look for modules, the environment a fresh
    rank would have been started with (the harness's as it is now, with the rank's own) and the one the fork
    server started with (from which the rank tells what the agent added)."""
    return [workdir, search_path(), {**os.environ, **rank_env(device)}, dict(_server_start_env)]


def forked_rank(workdir: str, search_path: list[str], harness_env: dict[str, str], server_env: dict[str, str]) -> int:
    """What the agent runs in each forked rank: ``zbench.rank.worker.forked`` (already imported there), in the
    environment a fresh rank would have: the harness's as it was when the case started (the fork server's dates
    from the first case), with the agent's per-rank variables (``RANK``, ``MASTER_PORT``, ...) over it.

    Note: a variable read only as a process starts (``LD_PRELOAD``, glibc's ``MALLOC_*``, ``PYTHON*``) keeps the
    value the fork server started with: export such variables before zbench starts.
    """
    _release_the_server()
    env = rank_environment(dict(os.environ), harness_env, server_env)
    os.environ.clear()
    os.environ.update(env)
    entry: Callable[[str, list[str]], int] = import_module(RANK_MODULE).forked
    return entry(workdir, search_path)


def _release_the_server() -> None:
    """Close this rank's end of the fork server's lifeline.

    Python hands every process the fork server forks the write end of the pipe whose closing tells the server
    that the harness and its clients are gone. A rank holding it keeps the server alive after the harness dies,
    and the server, its parent, keeps the rank alive (its parent-death signal waits for the server): orphans.
    The rank forks no process through the server, so it needs no end of it.
    """
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        setattr(server, "_forkserver_alive_fd", None)  # noqa: B010 (a private attribute mypy does not know)


def rank_environment(
    current: dict[str, str], harness_env: dict[str, str], server_env: dict[str, str]
) -> dict[str, str]:
    """The harness's environment with what the agent set in this rank (``current`` less ``server_env``) over it."""
    return {**harness_env, **{k: v for k, v in current.items() if server_env.get(k) != v}}


def search_path() -> list[str]:
    """Where a forked rank looks for modules first, as a fresh one would: the user's PYTHONPATH, then the working
    directory (where suites' plug-in implementations usually live)."""
    return [p for p in (*os.environ.get("PYTHONPATH", "").split(os.pathsep), os.getcwd()) if p]


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment meanwhile, as it was afterwards (what a process started inside
    inherits: the fork server, a fresh rank)."""
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
