"""Labels an implementation puts on its collectives, so the communication ledger checks logical volume.

Part of the protocol's toolkit: an implementation may import it, and it imports
nothing of the harness. The ledger (``zbench.measure.comms``) reads the label;
without the ledger installed a label costs one attribute write.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

_current = threading.local()


@dataclass
class Label:
    """A block of collectives that stands for one logical ``op`` of ``elements`` elements; recorded once."""

    op: str
    elements: int
    recorded: bool = False


@contextlib.contextmanager
def recorded_as(op: str, elements: int) -> Iterator[None]:
    """Record the collectives issued in this block as one logical ``op`` of ``elements`` elements.

    For an implementation that builds one collective from others on a backend
    where that is faster, as gloo's own reduce-scatter does (an all-reduce, then
    a slice) or an all-gather made of one broadcast per rank: the ledger then
    checks the logical volume, as the ZeRO formulas count it, rather than the
    backend workaround. It labels, it does not measure.
    """
    _current.label = Label(op, elements)
    try:
        yield
    finally:
        _current.label = None


def current() -> Label | None:
    """The label of the block this thread is in, if any."""
    return getattr(_current, "label", None)
