"""A free TCP port on this host, for a process group's store where no launcher picks one (the calibration's ranks,
the tests' and benchmarks' own groups)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it). Another process may take it before the store binds it, a
    race every such helper has (torch's own tests too); the store then fails to start, loudly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
