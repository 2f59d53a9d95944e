"""Files written whole or not at all: a temporary name in the same directory, fsync, then rename.

A reader (or a harness killed half-way) never sees half a file. Large files are
moved into place with ``os.replace`` rather than read and written again.
"""

from __future__ import annotations

import errno
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _file_mode() -> int:
    """The mode a plain ``open()`` would give a new file (mkstemp's 0600 honours no umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """``durable=False`` skips the fsync: still whole or absent to any reader, but a power cut may lose it, which
    suits what can be made again (a report's pages: 500 fsyncs were a third of a 500-case report's render)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), json.dumps(obj, indent=1, default=str).encode())


def atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def move_into_place(source: Path, target: Path) -> None:
    """Move a finished file to ``target`` atomically, without reading it (same file system: a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(source, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:  # another file system: copy next to the target (streamed), then rename
            raise
        import shutil

        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        Path(source).unlink()
