"""This rank's swap files for ZeRO-Infinity (``offload: nvme``) and the one I/O thread that reads and writes them.

A ``SwapDir`` is a per-engine directory under ``TrainSpec.nvme_dir`` (``rank<r>-<pid>-<random>``:
ranks share the directory, and one process may hold several engines) holding one file
per model-state category (``master_weights``, ``optimizer_state`` and, at stage 3,
``parameters``), so the bytes on disk can be measured per category with ``os.stat``. A file is a
sequence of ``Region``\\ s laid end to end, one per flat tensor.

Note: tensors move between files and preallocated buffers with plain positioned reads and writes
(``os.preadv`` / ``os.pwritev`` on the buffer's bytes), never ``mmap`` or ``torch.load``: mapped
file pages count in the process's resident set, which is exactly what moving state to disk must
lower. The kernel's page cache for these files is not part of any process's RSS. Both calls
release the GIL, so the I/O thread really runs alongside the training thread.

All reads and writes of a rank go through one thread in submission order (a FIFO): a read
submitted after a write of the same bytes sees the written data, which is what lets the optimizer
reuse a few buffers without locks. The directory is removed by ``close``, and by a
``weakref.finalize`` (which also runs at interpreter exit) if nobody called it.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake


def tracing() -> bool:
    """This thread runs under a ``FakeTensorMode`` (``zbench plan --trace``)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _bytes_of(t: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous CPU tensor, writable in place (any dtype, bf16 included); ``None`` for a
    fake tensor (``zbench plan --trace``), which has sizes but no bytes to move."""
    if is_fake(t):  # checked first: on the I/O thread a fake tensor's device can read "meta" mid-trace
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("swap I/O needs a contiguous host tensor")
    return t.detach().view(torch.uint8).numpy().data.cast("B")


class SwapFile:
    """One file of regions laid end to end, read and written at byte offsets."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = 0

    def allocate(self, numel: int, dtype: torch.dtype) -> Region:
        """A new region of ``numel`` elements at the end of the file, with its disk space reserved now."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        region = Region(self, self.size, numel, dtype, itemsize)
        nbytes = numel * itemsize
        if tracing():  # fake tensors: the file gets its size (what ``disk_bytes`` reports) but no blocks
            os.ftruncate(self.fd, self.size + nbytes)
            self.size += nbytes
            return region
        try:  # reserve the blocks, so that a full disk fails here, not in the middle of a step
            os.posix_fallocate(self.fd, self.size, nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(self.fd, self.size + nbytes)  # a file system without fallocate: a sparse file
        self.size += nbytes
        return region

    def read(self, offset: int, out: memoryview | None) -> None:
        if out is None:
            return
        done = 0
        while done < len(out):
            n = os.preadv(self.fd, [out[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += n

    def write(self, offset: int, data: memoryview | None) -> None:
        if data is None:
            return
        done = 0
        while done < len(data):
            done += os.pwritev(self.fd, [data[done:]], offset + done)

    def disk_bytes(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class Region:
    """One flat tensor's place in a swap file: ``numel`` elements of ``dtype`` from byte ``offset``."""

    file: SwapFile
    offset: int
    numel: int
    dtype: torch.dtype
    itemsize: int

    def _check(self, t: torch.Tensor, start: int) -> int:
        if t.dtype != self.dtype or start < 0 or start + t.numel() > self.numel:
            raise ValueError(
                f"{t.numel()} {t.dtype} elements from {start} do not fit a region of {self.numel} {self.dtype}"
            )
        return self.offset + start * self.itemsize

    def read(self, out: torch.Tensor, start: int = 0) -> None:
        """Fill ``out`` with elements ``[start, start + out.numel())``."""
        self.file.read(self._check(out, start), _bytes_of(out))

    def write(self, src: torch.Tensor, start: int = 0) -> None:
        """Store ``src`` as elements ``[start, start + src.numel())``."""
        self.file.write(self._check(src, start), _bytes_of(src))


def _remove(path: Path, files: dict[str, SwapFile], io: ThreadPoolExecutor) -> None:
    io.shutdown(wait=True)
    for f in files.values():
        f.close()
    shutil.rmtree(path, ignore_errors=True)


class SwapDir:
    """This rank's directory of swap files and its I/O thread."""

    def __init__(self, root: str | os.PathLike | None, *, rank: int, write_limit: int = 4) -> None:
        if root is None:
            raise ValueError("offload 'nvme' needs TrainSpec.nvme_dir: a directory for the swap files")
        if not Path(root).is_dir():
            raise ValueError(f"offload 'nvme': nvme_dir {str(root)!r} is not a directory")
        self.path = Path(tempfile.mkdtemp(prefix=f"rank{rank}-{os.getpid()}-", dir=root))
        self.write_limit = write_limit
        self._files: dict[str, SwapFile] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zero-swap-rank{rank}")
        self._writes: deque[Future] = deque()
        self._finalizer = weakref.finalize(self, _remove, self.path, self._files, self._io)

    def file(self, category: str) -> SwapFile:
        """The file of one model-state category, created on first use."""
        if category not in self._files:
            self._files[category] = SwapFile(self.path / f"{category}.bin")
        return self._files[category]

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` on the I/O thread, after everything submitted before."""
        return self._io.submit(fn, *args)

    def write_behind(self, region: Region, src: torch.Tensor, start: int = 0) -> None:
        """Write ``src`` (which the caller gives away) in the background; at most ``write_limit`` writes wait."""
        self._writes.append(self.submit(region.write, src, start))
        while len(self._writes) > self.write_limit or (self._writes and self._writes[0].done()):
            self._writes.popleft().result()

    def flush(self) -> None:
        """Wait for every background write (and raise the first I/O error)."""
        while self._writes:
            self._writes.popleft().result()

    def disk_bytes(self, category: str) -> int:
        f = self._files.get(category)
        return 0 if f is None or f.fd < 0 else f.disk_bytes()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Finish pending I/O, close the files and remove the directory (idempotent)."""
        if self._finalizer.alive:
            try:
                self.flush()
            finally:
                self._finalizer()
