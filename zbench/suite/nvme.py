"""The NVMe offload directory: checked before anything runs, one private sub-directory per case, removed after it.

A suite that offloads to NVMe names ``nvme_dir`` (a directory on the fast
local disk). Missing, not a directory, not writable, or without room for the
state the formulas say the cases will write there: each is one clear line and
exit 2 when the suite is loaded, and the room is checked again just before
each case (an earlier case, or another program, may have used it). Every case
writes into its own ``zbench-<run>-<case>`` sub-directory, which the harness
deletes when the case ends however it ended, so a killed rank leaves no swap
files behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from zbench.cases.case import Case
from zbench.cases.formulas import placement_for
from zbench.errors import UsageError

#: Room kept free beyond the predicted swap files (file-system metadata, rounding, other writers).
HEADROOM = 1.10
HEADROOM_BYTES = 64 * 2**20


def needed_bytes(case: Case) -> int:
    """Bytes a case writes under ``nvme_dir``: the formulas' disk share per rank, times its ranks, with headroom."""
    disk = placement_for(case)
    per_rank = sum(locs["disk"] for locs in disk.values())
    return int(per_rank * case.world_size * HEADROOM) + HEADROOM_BYTES


def check_directory(nvme_dir: str | None, needed: int, *, what: str) -> None:
    """Raise ``UsageError`` unless ``nvme_dir`` exists, is a writable directory and has ``needed`` bytes free."""
    if nvme_dir is None:
        raise UsageError(f"{what} offloads to NVMe but the suite sets no nvme_dir (a directory on a local disk)")
    path = Path(nvme_dir)
    if not path.exists():
        raise UsageError(f"nvme_dir {nvme_dir}: does not exist")
    if not path.is_dir():
        raise UsageError(f"nvme_dir {nvme_dir}: not a directory")
    try:  # really write: permission bits do not tell root about read-only mounts
        fd, probe = tempfile.mkstemp(prefix=".zbench-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"nvme_dir {nvme_dir}: not writable ({exc.strerror or exc})") from None
    free = shutil.disk_usage(path).free
    if free < needed:
        raise UsageError(
            f"nvme_dir {nvme_dir}: {free / 2**30:.2f} GiB free, {what} needs "
            f"{needed / 2**30:.2f} GiB for its offloaded state"
        )


def check_suite(cases: Sequence[Case], nvme_dir: str | None) -> None:
    """Up-front check for every NVMe case that will run; the largest need decides the room required."""
    nvme_cases = [c for c in cases if c.offload == "nvme" and c.skip_reason is None]
    if nvme_cases:
        need, biggest = max(((needed_bytes(c), c) for c in nvme_cases), key=lambda pair: pair[0])
        check_directory(nvme_dir, need, what=f"case {biggest.case_id}")


@contextmanager
def case_directory(case: Case, run_id: str) -> Iterator[str | None]:
    """A fresh sub-directory of ``nvme_dir`` for one case (``None`` for cases that do not offload to NVMe)."""
    if case.offload != "nvme":
        yield None
        return
    check_directory(case.nvme_dir, needed_bytes(case), what=f"case {case.case_id}")
    assert case.nvme_dir is not None  # checked just above
    path = Path(case.nvme_dir) / f"zbench-{run_id}-{case.case_id}"
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield str(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
