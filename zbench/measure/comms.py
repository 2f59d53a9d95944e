"""The communication ledger: every collective any implementation issues, counted at the c10d dispatcher.

Every ``torch.distributed`` collective, from Python (FSDP2, ZeroRedundancyOptimizer,
our engine, a plug-in) or from C++ (DDP's reducer), goes through a ``c10d::``
operator. ``install()`` registers a thin kernel for those operators at the
Autograd dispatch key, which records the call and re-dispatches below Autograd
to the real backend kernel (gloo, NCCL). Nothing else is intercepted, so the
cost is one Python call per collective, not per tensor operation.

Volumes are *logical*, per rank, in elements, as the ZeRO paper counts them
for ring algorithms: an all-reduce of n elements moves 2n (reduce-scatter +
all-gather), a reduce-scatter counts its input, an all-gather its output, a
broadcast its tensor. Bytes use the dtype actually sent (a bf16 gather is half
the bytes of an fp32 one). How a backend implements an operator on the wire
(gloo builds reduce-scatter from all-reduce) is not what is checked.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from zbench import comm_labels

# operator -> (ledger name, index of the argument whose size is the volume, ring factor)
_OPS = {
    "allreduce_": ("all_reduce", 0, 2),
    "allreduce_coalesced_": ("all_reduce", 0, 2),
    "broadcast_": ("broadcast", 0, 1),
    "_allgather_base_": ("all_gather", 0, 1),
    "allgather_": ("all_gather", 0, 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 1),
    "reduce_scatter_": ("reduce_scatter", 1, 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
}

_lock = threading.Lock()
_entries: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # (op, dtype) -> count, elements, bytes
_library: torch.library.Library | None = None
_calls: list[dict] | None = None  # one entry per collective, while ``log_calls`` is on (tracing)


def _flatten(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    return [t for item in arg for t in _flatten(item)]


def _kernel(op_name: str) -> Callable[..., Any]:
    name, index, factor = _OPS[op_name]
    op = getattr(torch.ops.c10d, op_name).default

    def record_and_forward(*args: Any, **kwargs: Any) -> Any:
        tensors = _flatten(args[index])
        label = comm_labels.current()
        if label is not None:  # the caller said what these collectives stand for: record that, once
            if not label.recorded:
                _record(label.op, tensors[0].dtype, label.elements, label.elements * tensors[0].element_size())
                label.recorded = True
        elif tensors:
            _record(
                name,
                tensors[0].dtype,
                factor * sum(t.numel() for t in tensors),
                factor * sum(t.numel() * t.element_size() for t in tensors),
            )
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    return record_and_forward


def _record(name: str, dtype: torch.dtype, elements: int, nbytes: int) -> None:
    with _lock:
        entry = _entries[(name, str(dtype).removeprefix("torch."))]
        entry[0] += 1
        entry[1] += elements
        entry[2] += nbytes
        if _calls is not None:
            _calls.append({"op": name, "bytes": nbytes, "backward": torch._C._current_graph_task_id() != -1})


def log_calls(on: bool) -> None:
    """Also keep every collective, in order, with whether autograd's backward pass issued it (``take_calls``):
    what the step-time simulator needs to know which compute a collective can hide behind."""
    global _calls
    with _lock:
        _calls = [] if on else None


def mark(name: str) -> None:
    """Put a marker between the logged collectives (the tracer marks where forward and backward end)."""
    with _lock:
        if _calls is not None:
            _calls.append({"mark": name})


def take_calls() -> list[dict]:
    """The collectives (``{op, bytes, backward}``) and markers (``{mark}``) logged since the last call, in order."""
    with _lock:
        out = list(_calls or [])
        if _calls is not None:
            _calls.clear()
    return out


def install() -> None:
    """Start recording collectives in this process (idempotent)."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("c10d", "IMPL")
    for op_name in _OPS:
        if hasattr(torch.ops.c10d, op_name):
            _library.impl(op_name, _kernel(op_name), "Autograd")


def uninstall() -> None:
    """Stop recording (used to measure the ledger's own cost against a bare run)."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def take() -> list[dict]:
    """The collectives recorded since the last ``take()``, then reset: ``[{op, dtype, count, elements, bytes}]``."""
    with _lock:
        out = [
            {"op": op, "dtype": dtype, "count": c, "elements": e, "bytes": b}
            for (op, dtype), (c, e, b) in sorted(_entries.items())
        ]
        _entries.clear()
    return out


def theory_elements(params: int, stage: int) -> int:
    """The ZeRO formulas per step and rank: DDP 2Ψ, ZeRO-1/2 2Ψ (reduce-scatter + all-gather), ZeRO-3 3Ψ
    (docs/methods.md#communication-volume)."""
    return 3 * params if stage >= 3 else 2 * params
