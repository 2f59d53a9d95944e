"""Run one case's real code (the model's build, the implementation's build, training steps) and account for it.

``trace_case`` is what ``zbench plan --trace`` runs for every implementation x
stage x offload mode: on fake tensors (``fake=True``: no memory, no arithmetic,
inside a ``fake`` process group of any size, see ``zbench.plan.trace.shims``), or on
real ones inside a real process group, which is how the fake figures are
checked (tests/test_trace.py). Both report the same things the same way:

- model-state bytes by category and location, from the engine's own
  ``state_bytes`` (what a real run records);
- every collective of the last step through the communication ledger
  (``zbench.measure.comms``), as a real run records it, and the same calls
  split by the phase that issued them (forward, backward, after backward),
  which the step-time simulator needs to know what each can hide behind;
- the peak of live tensor bytes per location during the last step and what it
  is made of (``zbench.plan.trace.live``).

A case that cannot be traced records its error in one line and the others go on;
``ZBENCH_TRACE_DEBUG=1`` prints its traceback too.

The first step creates the optimizer's state, before the second DDP re-orders
its buckets (a one-time broadcast); the third, the steady state, is measured.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.cases.model_source import build, model_info
from zbench.cases.models import checkpoint_blocks, rank_micro_batches
from zbench.measure import comms
from zbench.plan.trace.live import LiveBytes, Peak
from zbench.plan.trace.ops import OpLedger


@dataclass
class TraceResult:
    """One rank's account of one case; ``error`` (one line) when the implementation could not be traced."""

    case_id: str
    implementation: str
    stage: int
    offload: str
    world: int
    rank: int
    fake: bool
    device: str
    state_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    phases: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    """``{phase: {op: {"count", "bytes"}}}`` for the last step; phases ``forward``, ``backward``,
    ``after_backward`` (``phase_of``)."""
    peak: dict[str, dict[str, Any]] = field(default_factory=dict)
    ops: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The last step's operators by phase (``zbench.plan.trace.ops``)."""
    buffers: dict[str, int] = field(default_factory=dict)
    """Bytes by location of the engine's reusable buffers beyond its model state (``EngineBase.buffer_bytes``)."""
    seconds: float = 0.0
    error: str | None = None

    @property
    def comm_elements(self) -> int:
        return sum(c["elements"] for c in self.collectives)

    @property
    def comm_bytes(self) -> int:
        return sum(c["bytes"] for c in self.collectives)

    def to_json(self) -> dict[str, Any]:
        """The fields as they are, not copied (``asdict``'s deep copy of the ops took 3 s of a 64-GPU tune): every
        caller writes them out at once."""
        shallow = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**shallow, "comm_elements": self.comm_elements, "comm_bytes": self.comm_bytes}


def peak_json(peak: Peak) -> dict[str, Any]:
    """A location's peak, and each segment's (``zbench.plan.trace.live.Peak``)."""
    segments = {name: {"bytes": m.bytes, "roles": m.roles} for name, m in peak.segments.items()}
    return {"bytes": peak.bytes, "roles": peak.roles, "segments": segments}


def mark_blocks(model: torch.nn.Module, live: LiveBytes) -> contextlib.ExitStack:
    """Mark each block's forward (``forward I``) and backward (``backward I``) in ``live``'s segments, and the
    stretch after the last block's forward (``after blocks``: head and loss; their backward is ``mark_phases``'s
    ``backward start``). A block's backward
    begins when the gradient of its output is computed; a checkpointed block's recomputation, inside backward,
    marks nothing. Registered on the model's own blocks before an implementation wraps them (their hooks still
    fire inside its wrappers); removed when the returned stack closes."""
    stack = contextlib.ExitStack()
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        return stack
    last = len(blocks) - 1

    def in_backward() -> bool:
        return bool(torch._C._current_graph_task_id() != -1)

    def backward_hook(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            live.mark(f"backward {i}")
            return grad

        return hook

    for i, block in enumerate(blocks):

        def before(_module: torch.nn.Module, _args: object, i: int = i) -> None:
            if not in_backward():
                live.mark(f"forward {i}")

        def after(_module: torch.nn.Module, _args: object, out: object, i: int = i) -> None:
            if in_backward():
                return
            grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads:
                grads[0].register_hook(backward_hook(i))
            if i == last:
                live.mark("after blocks")

        stack.callback(block.register_forward_pre_hook(before).remove)
        stack.callback(block.register_forward_hook(after).remove)
    return stack


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


#: The segments of live bytes (``LiveBytes.mark``) that begin where a forward and a backward end.
SEGMENT_AFTER = {"forward_end": "backward start", "backward_end": "after backward"}


def mark_phases(model: torch.nn.Module, ops: OpLedger, live: LiveBytes) -> torch.utils.hooks.RemovableHandle:
    """Mark, in the ledger's call log, in ``ops`` and in ``live``'s segments, where each forward ends (the model
    returned its loss) and where each backward ends (autograd's queue-callback, queued from the loss's own
    gradient hook)."""

    def mark(name: str) -> None:
        comms.mark(name)
        ops.mark(name)
        live.mark(SEGMENT_AFTER[name])

    def backward_started(grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: mark("backward_end"))
        return grad

    def forward_ended(_module: torch.nn.Module, _args: object, loss: object) -> None:
        mark("forward_end")
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(backward_started)

    return model.register_forward_hook(forward_ended)


def phase_of(calls: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes and counts per phase and operator: a collective is ``forward`` when the next marker ends a forward,
    ``backward`` when it ends a backward, ``after_backward`` (the optimizer step) when no marker follows."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    upcoming: str | None = None
    for call in reversed(calls):
        if "mark" in call:
            upcoming = call["mark"]
            continue
        phase = {"forward_end": "forward", "backward_end": "backward", None: "after_backward"}[upcoming]
        entry = out.setdefault(phase, {}).setdefault(call["op"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += call["bytes"]
    return out


def _fake_mode() -> contextlib.AbstractContextManager[Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def why_untraceable(implementation: str) -> str | None:
    """Why an implementation's code cannot run on fake tensors here (absent, or declared untraceable), or None."""
    caps = registry.resolve(implementation).capabilities
    return caps.missing or caps.untraceable


@contextlib.contextmanager
def cycles_collected_between_steps() -> Iterator[None]:
    """Python's cycle collector runs before the step and not during it.

    Some of a step's garbage (FSDP2's per-layer state, autograd closures) sits in reference cycles, freed
    only when the collector runs, and it runs after a count of Python allocations: at a moment that moves
    with everything the process did before, and differently on fake tensors. Held off for the step, that
    garbage lives until the step ends in every run, fake or real. This removes the collector as a cause of
    variation; it is not the only one: FSDP2's real peak at world 4 still moves now and then with the order
    of gloo's threads (tests/test_trace.py, ``REPEATS``).
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


#: Steps a fake trace trains: the first creates the optimizer state, the second is recorded. Every built-in traced
#: the same figures (model states, collectives by phase, peak, operators) at two steps as at three, at gpt-70b cut
#: to 5 blocks, `small`, `small-tied` and `moe-tiny`, worlds 2-8, fp32 and bf16, with accumulation, checkpointing
#: and every offload mode (2026-11-28); a third step cost a quarter of each trace.
FAKE_STEPS = 2
#: Steps a real trace trains: a real DDP rebuilds its buckets before its second step, with a one-time broadcast,
#: which a fake DDP never does (``zbench.plan.trace.shims`` gives it the rebuilt buckets from the start).
REAL_STEPS = 3


def trace_case(
    case: Case,
    *,
    fake: bool,
    device: torch.device,
    steps: int | None = None,
    on_phase: Callable[[str], None] = lambda phase: None,
) -> TraceResult:
    """Build and train ``case`` for ``steps`` steps in the current process group (``dist.group.WORLD``), the last one
    recorded (default: ``FAKE_STEPS`` on fake tensors, ``REAL_STEPS`` on real ones).

    ``on_phase`` hears what the trace does next (building, wrapping, each step): the heartbeat's words.
    """
    steps = steps or (FAKE_STEPS if fake else REAL_STEPS)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != case.world_size:
        raise ValueError(f"case {case.case_id} is for {case.world_size} ranks, the process group has {world}")
    result = TraceResult(case.case_id, case.implementation, case.stage, case.offload, world, rank, fake, str(device))
    blocker = why_untraceable(case.implementation)
    if fake and blocker:
        result.error = f"cannot trace: {blocker}"
        return result
    comms.install()
    started = time.perf_counter()
    info = model_info(case.model)
    with contextlib.ExitStack() as stack:
        comms.log_calls(True)
        stack.callback(comms.log_calls, False)  # off again however the trace ends
        swap_dir = (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="zbench-trace-")) if case.offload == "nvme" else None
        )
        if fake:
            stack.enter_context(_fake_mode())
        live = stack.enter_context(LiveBytes(device))
        ops = stack.enter_context(OpLedger())
        try:
            on_phase(f"building {case.model}")
            model = build(case.model, seed=case.seed, device=device)
            if case.activation_checkpointing:
                checkpoint_blocks(model)
            stack.enter_context(mark_phases(model, ops, live))  # the hook is removed with the trace
            stack.enter_context(mark_blocks(model, live))
            on_phase(f"wrapping the model with {case.implementation}")
            engine = registry.resolve(case.implementation).build(
                model, case.train_spec(device, swap_dir=swap_dir), dist.group.WORLD
            )
            try:
                rows = case.micro_batch * case.grad_accum * world
                batch = torch.randint(0, info.vocab, (rows, case.seq_len + 1))
                micro_batches = rank_micro_batches(
                    batch, rank=rank, world=world, grad_accum=case.micro_batches_per_step, device=device
                )
                for step in range(steps):
                    on_phase(f"step {step + 1} of {steps}")
                    with cycles_collected_between_steps():
                        if step == steps - 1:
                            live.start_step()
                            ops.start_step()
                            comms.take()
                            comms.take_calls()
                        engine.step(micro_batches)
                result.collectives = comms.take()
                result.phases = phase_of(comms.take_calls())
                result.ops = ops.take()
                result.peak = {loc: peak_json(p) for loc, p in live.peaks.items()}
                result.state_bytes = engine.state_bytes()
                result.buffers = dict(getattr(engine, "buffer_bytes", dict)())  # an optional member
            finally:
                engine.close()
        except Exception as exc:  # one implementation that cannot be traced must not stop the others
            result.error = one_line(exc)
            if os.environ.get("ZBENCH_TRACE_DEBUG"):
                traceback.print_exc()
            comms.take()
    result.seconds = time.perf_counter() - started
    return result
