"""Sequential write and read of a file in a directory (the NVMe drive offload would swap to).

Note: a read straight after a write comes from the page cache at memory speed; after ``fsync`` the file's
pages are clean and ``posix_fadvise(DONTNEED)`` drops them, so the read goes to the drive. Where the call
is missing (not Linux) the read is marked as possibly cached.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from zbench.plan.simulate.calibration import DiskProbe

CHUNK = 8 * 2**20


def probe_disk(directory: Path, nbytes: int, repeats: int = 3) -> DiskProbe:
    path = directory / f".zbench-calibrate-{uuid.uuid4().hex}.bin"
    data = os.urandom(CHUNK)
    writes, reads, evicted = [], [], hasattr(os, "posix_fadvise")
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with open(path, "wb") as f:
                for _ in range(nbytes // CHUNK):
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
            writes.append(time.perf_counter() - start)
            with open(path, "rb") as f:
                if evicted:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                start = time.perf_counter()
                while f.read(CHUNK):
                    pass
                reads.append(time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)
    size = nbytes // CHUNK * CHUNK
    return DiskProbe(
        directory=str(directory),
        write_gb_s=size / sorted(writes)[len(writes) // 2] / 1e9,
        read_gb_s=size / sorted(reads)[len(reads) // 2] / 1e9,
        cache_evicted=evicted,
    )
