"""ZeRO-Infinity's disk tier: masters and optimizer state streamed from files, and stage 3's parameter shards in one.

``NvmeMasters`` keeps every group's fp32 master shard and optimizer state (e.g. AdamW's two
moments) in ``swap`` files and steps them in *sub-groups* of at most ``chunk_numel`` elements (and at most an
eighth of their group, down to 1 MiB: ``NvmeMasters.PIECES``):

    read(0)
    for j in sub-groups:  wait read(j); submit read(j+1); step(j); update shard(j); submit write(j)

with three reusable buffers (``_Slot``): while sub-group ``j`` is stepped on the training thread,
the I/O thread reads ``j+1`` ahead and writes ``j-1`` behind. The I/O thread runs jobs in order,
so the read into a buffer always comes after the write that emptied it. Peak memory is three
sub-groups, however large the model: the optimizer state is never resident as a whole.

Note: torch's AdamW and SGD are elementwise, so stepping sub-groups one at a time is bit-identical
to stepping the whole shard. Each sub-group is one ``nn.Parameter`` with a torch optimizer of its
own (one optimizer over all of them would walk every sub-group on each sub-group's step, which is
quadratic in their number); before its step the parameter's ``.data`` and its optimizer-state
tensors are pointed at the buffers just read, after it they are pointed away again. Only the tiny
per-sub-group step counters stay in memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch
from torch import nn

from zbench.implementations.zero.masters import Segment, check_masters
from zbench.implementations.zero.offload import HostToDevice, Upload, host_empty, upload_fence
from zbench.implementations.zero.state import Held
from zbench.implementations.zero.swap import Region, SwapDir
from zbench.implementations.zero.tiers import ParamTier
from zbench.protocol import TrainSpec
from zbench.state_bytes import same_memory

_NOTHING = torch.empty(0)


def flat_state_keys(spec: TrainSpec) -> tuple[str, ...]:
    """The optimizer-state entries that are tensors shaped like the parameter (AdamW: both moments; SGD: momentum).

    Found by stepping the spec's optimizer once on a two-element probe, so any elementwise torch
    optimizer works without a table of names.
    """
    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    optimizer = spec.make_optimizer([probe])
    optimizer.step()
    return tuple(k for k, v in optimizer.state[probe].items() if torch.is_tensor(v) and v.shape == probe.shape)


@dataclass
class _Group:
    numel: int
    master: Region
    state: dict[str, Region]
    tier: ParamTier


@dataclass
class _Sub:
    """Elements ``[lo, hi)`` of group ``group``'s shard, stepped by its own ``optimizer`` over ``param``."""

    group: int
    lo: int
    hi: int
    optimizer: torch.optim.Optimizer
    param: nn.Parameter

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def state(self) -> dict:
        return self.optimizer.state[self.param]


class _Slot:
    """One sub-group's worth of master and state buffers (pinned on CUDA)."""

    def __init__(self, numel: int, keys: Sequence[str], *, device: torch.device) -> None:
        self.master = host_empty(numel, torch.float32, device=device)
        self.state = {k: host_empty(numel, torch.float32, device=device) for k in keys}
        self.uploaded: torch.cuda.Event | None = None
        """CUDA: the copy of ``master`` to the device; the next read into this slot waits for it."""


class NvmeMasters:
    """Master shards and optimizer state in files, stepped sub-group by sub-group (see the module docstring)."""

    SLOTS = 3
    PIECES = 8
    """Each group is cut into at least this many sub-groups where they stay at least ``FLOOR`` elements, so that the
    three buffered sub-groups stay a fraction of the state they stream when a group is smaller than
    ``chunk_numel`` (``medium``'s untied embeddings at world 2 would otherwise buffer 228 MB for 246 MB of
    state at the 64 MiB default). Per group, not per shard: a block's sub-groups are the same at any depth,
    which ``zbench tune``'s extrapolation over blocks relies on."""
    FLOOR = 2**18
    """1 MiB of fp32: below it a sub-group's fixed cost (an optimizer call, its I/Os) outweighs its bytes."""

    def __init__(self, spec: TrainSpec, *, swap: SwapDir, chunk_numel: int) -> None:
        self.spec = spec
        self.device = spec.device
        self.home = torch.device("cpu")
        self.swap = swap
        self.chunk_numel = chunk_numel
        self.keys = flat_state_keys(spec)
        self._groups: list[_Group] = []
        self._subs: list[_Sub] = []
        self._slots: list[_Slot] | None = None
        self._started = False
        """Whether the optimizer state on disk is valid (the first step that was not skipped initialises it)."""
        self.trace: list[tuple[str, int, str]] | None = None
        """When a list: ``(read|step|write, sub-group, begin|end)`` events, appended as they happen (tests)."""

    def add(self, master: torch.Tensor, tier: ParamTier, segments: Sequence[Segment]) -> None:
        numel = master.numel()
        group = _Group(
            numel,
            self.swap.file("master_weights").allocate(numel, torch.float32),
            {k: self.swap.file("optimizer_state").allocate(numel, torch.float32) for k in self.keys},
            tier,
        )
        group.master.write(master.detach().to("cpu", torch.float32).contiguous())
        index = len(self._groups)
        self._groups.append(group)
        size = min(self.chunk_numel, max(self.FLOOR, -(-numel // self.PIECES)))
        for lo in range(0, numel, size):
            param = nn.Parameter(torch.empty(0))
            hi = min(numel, lo + size)
            self._subs.append(_Sub(index, lo, hi, self.spec.make_optimizer([param]), param))

    @property
    def _slot_numel(self) -> int:
        """Elements of one buffer slot: the largest sub-group."""
        return max(s.numel for s in self._subs)

    def _buffers(self) -> list[_Slot]:
        if self._slots is None:
            self._slots = [_Slot(self._slot_numel, self.keys, device=self.device) for _ in range(self.SLOTS)]
        return self._slots

    def _record(self, kind: str, j: int, edge: str) -> None:
        if self.trace is not None:
            self.trace.append((kind, j, edge))

    # --- the streamed step -----------------------------------------------------------------------------------

    def step(self, grads: Sequence[torch.Tensor], *, skip: Sequence[set[int]] | None = None) -> None:
        """``skip`` must be empty: models that may leave parameters unused are refused (``Placement``)."""
        if skip and any(skip):
            raise ValueError("zero: nvme offload steps flat sub-groups and cannot leave a parameter untouched")
        if len(grads) != len(self._groups):
            raise ValueError(f"{len(grads)} gradient shards for {len(self._groups)} groups")
        slots = self._buffers()
        n = len(self._subs)
        jobs: list[Future] = []
        try:
            reading = self.swap.submit(self._read, 0, slots[0], self._io_views(0, slots[0], with_state=self._started))
            jobs.append(reading)
            for j, sub in enumerate(self._subs):
                slot = slots[j % self.SLOTS]
                reading.result()
                if j + 1 < n:
                    nxt = slots[(j + 1) % self.SLOTS]
                    reading = self.swap.submit(
                        self._read, j + 1, nxt, self._io_views(j + 1, nxt, with_state=self._started)
                    )
                    jobs.append(reading)
                self._step_one(j, slot, grads[sub.group][sub.lo : sub.hi])
                self._groups[sub.group].tier.update(sub.lo, sub.hi, slot.master[: sub.numel])
                slot.uploaded = upload_fence(self.device)  # the tier's copy to the device reads this slot
                jobs.append(self.swap.submit(self._write, j, self._io_views(j, slot, with_state=True)))
        finally:
            wait(jobs)
        for job in jobs:
            job.result()  # raise an I/O error, if any
        self.swap.flush()
        self._started = True

    def _io_views(self, j: int, slot: _Slot, *, with_state: bool) -> list[tuple[Region, torch.Tensor]]:
        """Sub-group ``j``'s regions and the views of ``slot`` they fill or empty, made on the training thread
        (the I/O thread only moves bytes; it runs no tensor operation)."""
        sub = self._subs[j]
        group = self._groups[sub.group]
        views = [(group.master, slot.master[: sub.numel])]
        if with_state:
            views += [(region, slot.state[k][: sub.numel]) for k, region in group.state.items()]
        return views

    def _read(self, j: int, slot: _Slot, views: list[tuple[Region, torch.Tensor]]) -> None:
        """I/O thread: sub-group ``j``'s master (and state, once there is some) into ``slot``."""
        self._record("read", j, "begin")
        if slot.uploaded is not None:
            slot.uploaded.synchronize()
            slot.uploaded = None
        lo = self._subs[j].lo
        for region, view in views:
            region.read(view, lo)
        self._record("read", j, "end")

    def _write(self, j: int, views: list[tuple[Region, torch.Tensor]]) -> None:
        """I/O thread: sub-group ``j``'s updated master and state from its slot back to disk."""
        self._record("write", j, "begin")
        lo = self._subs[j].lo
        for region, view in views:
            region.write(view, lo)
        self._record("write", j, "end")

    def _step_one(self, j: int, slot: _Slot, grad: torch.Tensor) -> None:
        """Step sub-group ``j`` in place in ``slot``: point its parameter and state at the buffers, step, point away."""
        self._record("step", j, "begin")
        sub = self._subs[j]
        p, n = sub.param, sub.numel
        p.data = slot.master[:n]
        p.grad = grad
        state = sub.state
        if self._started:
            for k in self.keys:
                state[k] = slot.state[k][:n]
        try:
            sub.optimizer.step()
        finally:
            p.grad = None
            p.data = _NOTHING
        for k in self.keys:  # on the first step the optimizer created its state itself: keep it in the slot
            view = slot.state[k][:n]
            if not same_memory(state[k], view):
                view.copy_(state[k])
            del state[k]
        self._record("step", j, "end")

    # --- reading it all back ---------------------------------------------------------------------------------

    def _read_whole(self, region: Region) -> torch.Tensor:
        out = torch.empty(region.numel, dtype=region.dtype)
        region.read(out)
        return out

    def masters(self) -> Iterator[torch.Tensor]:
        self.swap.flush()
        for group in self._groups:
            yield self._read_whole(group.master)

    def state_dict(self) -> dict:
        """The same layout ``InMemoryMasters`` saves: state read back from disk, one flat tensor per group."""
        self.swap.flush()
        hyper = {k: v for k, v in self._subs[0].optimizer.param_groups[0].items() if k != "params"}
        state: dict[int, dict] = {}
        if self._started:
            for i, group in enumerate(self._groups):
                first = next(s for s in self._subs if s.group == i)  # every sub-group has taken the same steps
                entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.state.items()}
                entry.update({k: self._read_whole(region) for k, region in group.state.items()})
                state[i] = entry
        return {
            "masters": [self._read_whole(g.master) for g in self._groups],
            "optimizer": {"state": state, "param_groups": [{**hyper, "params": list(range(len(self._groups)))}]},
        }

    def load_state_dict(self, state: dict) -> None:
        check_masters(state["masters"], [g.numel for g in self._groups])
        saved = state["optimizer"]
        entries = {int(i): e for i, e in saved["state"].items()}
        if entries and set(entries) != set(range(len(self._groups))):
            raise ValueError(
                f"checkpoint has optimizer state for groups {sorted(entries)}, "
                f"this engine has {len(self._groups)} groups"
            )
        self.swap.flush()
        for i, (group, master) in enumerate(zip(self._groups, state["masters"])):
            master = master.detach().to("cpu", torch.float32).contiguous()
            group.master.write(master)
            group.tier.update(0, group.numel, master)
            if entries:
                for k, region in group.state.items():
                    region.write(entries[i][k].detach().to("cpu", torch.float32).contiguous())
        small = {i: {k: v for k, v in e.items() if k not in self.keys} for i, e in entries.items()}
        hyper = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        for sub in self._subs:
            sub.optimizer.state.clear()
            if entries:
                sub.optimizer.state[sub.param] = {
                    k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in small[sub.group].items()
                }
            sub.optimizer.param_groups[0].update(hyper)
        self._started = bool(entries)
        self.swap.flush()

    def held(self) -> dict[str, Held]:
        return {
            "optimizer_state": Held(disk=self.swap.disk_bytes("optimizer_state")),
            "master_weights": Held(disk=self.swap.disk_bytes("master_weights")),
        }

    def buffer_bytes(self) -> dict[str, int]:
        """The host buffers of ``SLOTS`` sub-groups (fp32 master and each optimizer-state tensor), held from the
        first step on: ``zbench tune`` adds them to a rank's host memory, and takes them out of the CPU
        stand-in's device peak, whose trace cannot tell them from device memory."""
        if not self._subs:
            return {}
        return {"host": self.SLOTS * (1 + len(self.keys)) * self._slot_numel * 4}

    def close(self) -> None:
        self._slots = None


class DiskShard:
    """Stage 3 under ``nvme``: this rank's compute-dtype parameter shard lives in the ``parameters`` swap file.

    ``fetch`` (part of the stage-3 prefetch, one block further ahead than the all-gathers) reads it
    on the I/O thread into a host buffer; ``take`` waits for the read and, on CUDA, copies the
    buffer to the device. After the step, ``update`` writes each updated sub-group back, behind.
    """

    location = "disk"

    def __init__(self, values: torch.Tensor, *, swap: SwapDir, h2d: HostToDevice) -> None:
        self.region = swap.file("parameters").allocate(values.numel(), values.dtype)
        self.region.write(values.detach().cpu().contiguous())
        self._swap = swap
        self._h2d = h2d
        self._read: Future | None = None
        self._buffer: torch.Tensor | None = None

    def fetch(self) -> None:
        if self._read is None:
            self._buffer = host_empty(self.region.numel, self.region.dtype, device=self._h2d.device)
            self._read = self._swap.submit(self.region.read, self._buffer)

    def take(self) -> torch.Tensor:
        self.fetch()
        assert self._read is not None and self._buffer is not None  # set by fetch
        self._read.result()
        buffer, self._read, self._buffer = self._buffer, None, None
        upload: Upload = self._h2d.start(buffer, owned=True)
        return upload.ready()

    def drop(self) -> None:
        if self._read is not None:
            self._read.result()
            self._read = self._buffer = None

    def update(self, lo: int, hi: int, values: torch.Tensor) -> None:
        self._swap.write_behind(self.region, values.to(self.region.dtype, copy=True), lo)

    def held(self) -> Held:
        return Held()  # the bytes are counted from the file's size
