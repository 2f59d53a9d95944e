"""Live tensor bytes of one rank, its peak, and what the peak is made of: one accounting for fake and real tensors.

``LiveBytes`` is a ``TorchDispatchMode``: every operator output's storage is
recorded once (bytes and device) with a weak reference that takes it off the
books when torch frees it. So the same figure comes out of a fake trace (no
memory anywhere) and of a real run (where it can be checked), which is how
``zbench plan --trace`` is validated (tests/test_trace.py). It counts tensor
storages, not allocator blocks: no rounding, caching or fragmentation (the CUDA
allocator's peak is higher by those).

Each storage has a role, the composition of the peak:

- ``held between steps``: alive when the measured step began (model states, and
  buffers an implementation keeps, such as DDP's gradient buckets);
- ``gathered parameters``: outputs of an all-gather (ZeRO-3/FSDP units, ZeRO-1/2's
  updated parameters);
- ``communication buffers``: other tensors handed to a collective (gradient
  buckets, reduce-scatter inputs and outputs, all-gather inputs);
- ``activations``: saved by autograd for the backward pass;
- ``backward temporaries``: anything else made during backward (gradients
  before they are reduced, recomputation);
- ``other temporaries``: anything else made outside backward (forward scratch,
  the optimizer step's temporaries, copies to and from the host).

A storage takes the first role that applies, in the order above; a storage
made during the step and later sent or saved for backward becomes a buffer
or an activation from then on (a gathered weight saved for backward stays a
gathered parameter).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

HELD = "held between steps"
ACTIVATIONS = "activations"
GATHERED = "gathered parameters"
COMM = "communication buffers"
BACKWARD = "backward temporaries"
OTHER = "other temporaries"
ROLES = (HELD, GATHERED, COMM, ACTIVATIONS, BACKWARD, OTHER)

_RESIZES = {torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Storage}
_GATHERS = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"}


@dataclass
class _Storage:
    nbytes: int
    location: str
    role: str


@dataclass
class Moment:
    """Live bytes of one location at one moment of the step, and their roles."""

    bytes: int = 0
    roles: dict[str, int] = field(default_factory=dict)


#: The segment of the step before the first ``LiveBytes.mark``.
STEP_START = "step start"


@dataclass
class Peak(Moment):
    """The most live bytes one location held at once, and their roles at that moment; ``segments``: the same for
    each stretch of the step between two marks (``LiveBytes.mark``: the tracer marks each block's forward and
    backward, ``zbench.plan.trace.tracer.mark_blocks``).

    The segments are what a peak becomes in a deeper model: each is the same stretch of the step at any depth,
    growing with depth on a line of its own, so the peak of a deep model may lie in a segment that is not the
    peak of a shallow one (a stage-2 FSDP1 step peaks early in backward at 2 blocks, at its end at 24:
    ``zbench.tune.extrapolate``)."""

    segments: dict[str, Moment] = field(default_factory=dict)


class LiveBytes(TorchDispatchMode):
    """Count live storages by location (``device``: the compute device; ``host``: any other) and role."""

    def __init__(self, compute_device: torch.device) -> None:
        super().__init__()
        self.compute_device = torch.device(compute_device)
        self._live: dict[int, _Storage] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current: Counter[tuple[str, str]] = Counter()
        self.peaks: dict[str, Peak] = {}
        self._segment = STEP_START
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._saved, lambda t: t)

    # -- bookkeeping -----------------------------------------------------------------------------

    def _location(self, t: torch.Tensor) -> str:
        return "device" if t.device == self.compute_device else "host"

    def _forget(self, key: int, _ref: object) -> None:
        entry = self._live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self.current[(entry.location, entry.role)] -= entry.nbytes

    def track(self, t: torch.Tensor, role: str) -> None:
        """Count ``t``'s storage if it is new (with ``role``), else move it to ``role`` if that ranks higher."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor: its storage is notional, at the global size;
            for name in t.__tensor_flatten__()[0]:  # the memory is its local tensor's
                self.track(getattr(t, name), role)
            return
        storage = t.untyped_storage()
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            entry = _Storage(nbytes, self._location(t), role)
            self._live[key] = entry
            self._refs[key] = weakref.ref(storage, partial(self._forget, key))
            self.current[(entry.location, role)] += nbytes
            self._update_peak(entry.location)
        elif ROLES.index(role) < ROLES.index(entry.role) and entry.role != HELD:
            self.current[(entry.location, entry.role)] -= entry.nbytes
            entry.role = role
            self.current[(entry.location, role)] += entry.nbytes

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size in place: FSDP2 frees and re-allocates its gathered parameters that way
        (``untyped_storage().resize_``), which no operator output reports."""
        entry = self._live.get(storage._cdata)
        if entry is None:
            return
        nbytes = storage.nbytes()
        self.current[(entry.location, entry.role)] -= entry.nbytes
        if entry.nbytes == 0 and nbytes:  # freed in place earlier, allocated again now: a temporary of this moment
            entry.role = BACKWARD if torch._C._current_graph_task_id() != -1 else OTHER  # (a gather then claims it)
        self.current[(entry.location, entry.role)] += nbytes
        entry.nbytes = nbytes
        self._update_peak(entry.location)

    def _update_peak(self, location: str) -> None:
        total = self.live_bytes(location)
        peak = self.peaks.setdefault(location, Peak())
        segment = peak.segments.setdefault(self._segment, Moment())
        if total > segment.bytes:
            segment.bytes, segment.roles = total, self._roles(location)
            if total > peak.bytes:
                peak.bytes, peak.roles = total, segment.roles

    def _roles(self, location: str) -> dict[str, int]:
        return {role: b for (loc, role), b in self.current.items() if loc == location and b}

    def live_bytes(self, location: str) -> int:
        return sum(b for (loc, _), b in self.current.items() if loc == location)

    # -- measuring ---------------------------------------------------------------------------------

    def hold(self, tensors: Any) -> None:
        """Count what already exists (the model, an engine's buffers) as held between steps."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self.track(t, HELD)

    def start_step(self) -> None:
        """Everything alive now is held between steps; the peaks start over from it."""
        for entry in self._live.values():
            self.current[(entry.location, entry.role)] -= entry.nbytes
            entry.role = HELD
            self.current[(entry.location, HELD)] += entry.nbytes
        self.peaks = {}
        self.mark(STEP_START)

    def mark(self, segment: str) -> None:
        """A new stretch of the step begins (its peak starts from what is live now); a name met again (the next
        micro-batch's) keeps the larger of its peaks."""
        self._segment = segment
        for location in {e.location for e in self._live.values()}:
            self._update_peak(location)

    def _saved(self, t: torch.Tensor) -> torch.Tensor:
        self.track(t, ACTIVATIONS)
        return t

    def __enter__(self) -> LiveBytes:
        self._saved_hooks.__enter__()
        storage_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            out = storage_resize(storage, size)
            self.resized(storage)
            return out

        self._storage_resize = storage_resize
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]  # restored in __exit__
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._storage_resize  # type: ignore[method-assign]
        self._saved_hooks.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        collective = func.namespace == "c10d"
        if collective:  # what a collective fills or sends is a buffer, whoever made it
            gather = func._opname in _GATHERS
            for i, arg in enumerate(args):
                for t in tree_leaves(arg):
                    if isinstance(t, torch.Tensor):
                        self.track(t, GATHERED if gather and i == 0 else COMM)
        out = func(*args, **kwargs)
        if func in _RESIZES:
            self.resized(args[0].untyped_storage())
        if not collective:
            role = BACKWARD if torch._C._current_graph_task_id() != -1 else OTHER
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t, role)
        return out
