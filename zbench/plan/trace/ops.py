"""The compute one rank runs in a step, operator by operator, with the phase that ran it.

The step-time model charges each operator its own time from a calibrated profile (matrix products at the
measured rate for their size and dtype, everything else at the measured memory bandwidth, each call its
dispatch cost) instead of one FLOPs-over-peak figure. ``OpLedger`` records, for the measured step, every
operator that computes or moves memory: its name, dtype, input shapes, FLOPs (torch's own formulas,
``torch.utils.flop_counter``), bytes read and written, bytes of the tensors it created that a CPU rank maps
fresh from the system (each at least ``CPU_MMAP_THRESHOLD_BYTES``: ``zbench.measure.memory``), and how often it
ran. Views, small empty tensors and collectives (the communication ledger's) are left out; a large empty tensor
is kept for its mapped bytes (its pages are faulted in by whatever writes it first), and so is a storage grown
in place (``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2 and the reference engine's stage 3 free
their gathered parameters that way after each use and grow them again for the next all-gather, so every gather
maps its bytes afresh).
Identical calls are kept once with a count, so a 70B model's 80 identical layers cost 1 entry each, not 80.

Phases follow the tracer's markers (``zbench.plan.trace.tracer.mark_phases``): what runs before a forward's
end is ``forward``, before a backward's end ``backward`` (recomputation under activation checkpointing
included), after the last backward ``after_backward`` (the optimizer step).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from zbench.measure.memory import CPU_MMAP_THRESHOLD_BYTES

#: Operators that neither compute nor move memory: a fresh tensor's allocation (kept only when it is large enough
#: to be mapped on a CPU rank) and autograd bookkeeping.
ALLOCATING = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
FREE = ALLOCATING | {"detach", "alias", "lift_fresh"}
MARKS = {"forward_end": "forward", "backward_end": "backward"}

_Key = tuple[str, str, tuple[tuple[int, ...], ...], int, int, int]


def _cpu_attention_flops(func: Any, args: Any) -> int | None:
    """The CPU build's fused attention, which torch's FLOP formulas do not list (they cover the CUDA kernels):
    the same count as theirs, from the query, key and value shapes."""
    name = func._opname
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        return int(sdpa_flop_count(*(a.shape for a in args[:3])))
    if name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        return int(sdpa_backward_flop_count(*(a.shape for a in args[:4])))
    return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _entry(key: _Key, count: int) -> dict[str, Any]:
    op, dtype, shapes, flops, nbytes, mapped = key
    return {
        "op": op,
        "dtype": dtype,
        "shapes": [list(s) for s in shapes],
        "flops": flops,
        "bytes": nbytes,
        "mapped_bytes": mapped,
        "count": count,
    }


class OpLedger(TorchDispatchMode):
    """Operators by phase, for the step between ``start_step`` and ``take``."""

    def __init__(self) -> None:
        super().__init__()
        self._recording = False
        self._segments: list[tuple[Counter[_Key], str | None]] = []
        self._current: Counter[_Key] = Counter()

    def __enter__(self) -> OpLedger:
        self._plain_resize = torch.UntypedStorage.resize_
        ledger, plain = self, self._plain_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            grown = size - storage.nbytes()
            out = plain(storage, size)
            ledger._record_mapped("resize_", "uint8", (size,), grown)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._plain_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def start_step(self) -> None:
        self._recording, self._segments, self._current = True, [], Counter()

    def mark(self, name: str) -> None:
        """A forward or a backward ended: what ran since belongs to that phase."""
        if self._recording:
            self._segments.append((self._current, name))
            self._current = Counter()

    def take(self) -> dict[str, list[dict[str, Any]]]:
        """``{phase: [{op, dtype, shapes, flops, bytes, mapped_bytes, count}]}`` of the recorded step; recording
        stops."""
        segments = [*self._segments, (self._current, None)]
        self._recording = False
        merged: dict[str, Counter[_Key]] = {}
        for counts, mark in segments:
            phase = MARKS.get(mark or "", "after_backward")
            merged.setdefault(phase, Counter()).update(counts)
        return {
            phase: [_entry(key, count) for key, count in sorted(counts.items())]
            for phase, counts in merged.items()
            if counts
        }

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._recording and func.namespace == "aten" and not func.is_view:
            if func._opname not in FREE:
                self._record(func, args, kwargs, out)
            elif func._opname in ALLOCATING and isinstance(out, torch.Tensor):
                self._record_mapped(func._opname, _dtype_name(out), tuple(out.shape), _nbytes(out))
        return out

    def _record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        read, written, first, fresh = _moved_bytes(func, args, kwargs, out)
        if first is None:
            return
        counter = flop_registry.get(func._overloadpacket)
        flops = _cpu_attention_flops(func, args)
        if flops is None:
            flops = int(counter(*args, **kwargs, out_val=out)) if counter is not None else 0
        dtype = _dtype_name(first)
        shapes = tuple(tuple(t.shape) for t in _tensors((args, kwargs)))
        mapped = sum(n for n in map(_nbytes, fresh) if n >= CPU_MMAP_THRESHOLD_BYTES)
        name = str(func._overloadpacket).removeprefix("aten.")
        self._current[(name, dtype, shapes, flops, read + written, mapped)] += 1

    def _record_mapped(self, name: str, dtype: str, shape: tuple[int, ...], size: int) -> None:
        """Fresh memory and nothing moved (a large empty tensor, a storage grown in place): ``size`` bytes a CPU rank
        maps, kept only from the mmap threshold up."""
        if self._recording and size >= CPU_MMAP_THRESHOLD_BYTES:
            self._current[(name, dtype, (shape,), 0, 0, size)] += 1


def _moved_bytes(
    func: Any, args: Any, kwargs: dict[str, Any], out: Any
) -> tuple[int, int, torch.Tensor | None, list[torch.Tensor]]:
    """``(bytes read, bytes written, the first tensor, the tensors it created)`` of one call, from its schema: an
    argument marked as written (``Tensor(a!)``: in place, or ``out=``) is written, and read too unless it is an
    ``out=`` argument; a returned tensor is written unless the schema says it aliases an argument (counted
    there). So ``add_`` moves self twice and other once, ``add(out=)`` reads two and writes one, and
    ``_foreach_add_`` writes its list, which it does not return."""
    schema = func._schema
    named = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
    read = written = 0
    first: torch.Tensor | None = None
    for arg in schema.arguments:
        tensors = _tensors(named.get(arg.name))
        if not tensors:
            continue
        first = tensors[0] if first is None else first
        size = sum(map(_nbytes, tensors))
        is_write = arg.alias_info is not None and arg.alias_info.is_write
        written += size if is_write else 0
        read += 0 if (is_write and arg.kwarg_only) else size
    fresh = _tensors([t for r, t in zip(schema.returns, _returned(out), strict=False) if r.alias_info is None])
    written += sum(map(_nbytes, fresh))
    if first is None and fresh:
        first = fresh[0]
    return read, written, first, fresh


def _returned(out: Any) -> list[Any]:
    return list(out) if isinstance(out, tuple | list) and not isinstance(out, torch.Tensor) else [out]
