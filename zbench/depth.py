"""A model cut to its first few blocks, by name: ``gpt-70b@blocks=3`` is gpt-70b's width, embeddings and head with
3 of its 87 blocks.

``zbench tune`` traces such cuts at two depths and extrapolates over blocks (``zbench.tune.extrapolate``): a
step's bytes, collectives and operators are one part that does not depend on depth plus one per block. The cut
works for presets and published or local transformers architectures; a builder's model (``module:builder``)
has no depth zbench can change.
"""

from __future__ import annotations

SEPARATOR = "@blocks="


def at_depth(name: str, blocks: int) -> str:
    """``name`` cut to ``blocks`` blocks."""
    return f"{name}{SEPARATOR}{blocks}"


def split_depth(name: str) -> tuple[str, int | None]:
    """``(the full model's name, blocks)``, blocks None when ``name`` is not cut; a bad count raises ValueError."""
    base, sep, count = name.rpartition(SEPARATOR)
    if not sep:
        return name, None
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"model {name!r}: {SEPARATOR}N needs a whole number of blocks >= 1, not {count!r}")
    return base, int(count)
