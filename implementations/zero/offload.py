"""The host tier of ZeRO-Offload: gradient partitions and parameter shards in host memory, and copies to and from it.

On CUDA, host tensors are pinned and copies run on side streams with ``non_blocking``, so that
they overlap compute; events say when the host may read (gradients) or overwrite (parameters) a
buffer. On a CPU-only run the compute device is the CPU as well: the host tier is then plain
separate tensors and plain copies, which keeps the accounting (device copy apart from host copy)
and the code path the same.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from zbench.implementations.zero.state import Held


def host_empty(numel: int, dtype: torch.dtype, *, device: torch.device) -> torch.Tensor:
    """A host buffer, pinned when ``device`` is a GPU (so copies to and from it can be asynchronous)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def upload_fence(device: torch.device) -> torch.cuda.Event | None:
    """After writing a host buffer that queued copies to ``device`` read: an event that passes once they have
    read it (wait on it before writing the buffer again); ``None`` off CUDA, where copies are synchronous."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class DeviceToHost:
    """Reduced gradient shards copied from the device into fp32 host partitions, off the training stream.

    Note: on CUDA a side stream waits for the stream that produced the gradient, then copies into
    pinned memory without blocking. The first micro-batch of a step copies straight into the
    partition; later ones land in a pinned staging buffer and are added on the host once that copy
    has finished (at most ``limit`` stagings wait at any time, so the step never holds a second copy
    of the partition). ``drain`` waits for everything before the optimizer reads the partitions.
    """

    def __init__(self, device: torch.device, *, limit: int = 2) -> None:
        self.device = device
        self.limit = limit
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._pending: deque[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = deque()
        self._last: torch.cuda.Event | None = None

    def copy(self, src: torch.Tensor, dst: torch.Tensor, *, accumulate: bool) -> None:
        """``dst = src`` or ``dst += src``: ``src`` a gradient on the device, ``dst`` an fp32 host partition."""
        if not self._cuda:
            if accumulate:
                dst.add_(src)
            else:
                dst.copy_(src)
            return
        stream = self._stream
        assert stream is not None  # created with self._cuda
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            src.record_stream(stream)  # its producer may free it on its own stream before this copy runs
            src32 = src.float()  # cast on the device, so the copy is a plain asynchronous memcpy
            target = host_empty(dst.numel(), torch.float32, device=self.device) if accumulate else dst
            target.copy_(src32, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._last = event
        if accumulate:
            self._pending.append((event, target, dst))
            self._settle(block=False)

    def _settle(self, *, block: bool) -> None:
        """Add staged micro-batches into their partitions: the finished ones, the oldest beyond ``limit``, or all."""
        while self._pending and (block or len(self._pending) > self.limit or self._pending[0][0].query()):
            event, staging, dst = self._pending.popleft()
            event.synchronize()
            dst.add_(staging)

    def drain(self) -> None:
        """Wait until every copy has landed and every staged micro-batch is added (before the host step)."""
        if not self._cuda:
            return
        self._settle(block=True)
        if self._last is not None:
            self._last.synchronize()  # copies run in order on one stream: the last done means all done
            self._last = None


@dataclass
class Upload:
    """A host-to-device copy in flight: ``tensor`` on the device, valid once ``event`` has passed."""

    tensor: torch.Tensor
    event: torch.cuda.Event | None = None

    def ready(self) -> torch.Tensor:
        """The device tensor, with the current stream ordered after the copy (the host thread does not block)."""
        if self.event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
        return self.tensor

    def synchronize(self) -> None:
        """Block the host until the copy has read its source (before the source may be overwritten)."""
        if self.event is not None:
            self.event.synchronize()


class HostToDevice:
    """Host-to-device copies of parameter shards on a side stream, started ahead of their use (stage 3 prefetch)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None

    def start(self, host: torch.Tensor, *, owned: bool = False) -> Upload:
        """Start copying ``host`` to the device; ``owned``: the caller gives ``host`` away (the CPU then uses it as is).

        Note: the device buffer is allocated on the current stream, which the side stream waits
        for; the consumer waits for the copy's event (``Upload.ready``) before using or freeing it,
        so the caching allocator never hands the buffer out while the copy still writes it.
        """
        if not self._cuda:
            return Upload(host if owned else host.clone())
        stream = self._stream
        assert stream is not None  # created with self._cuda
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Upload(out, event)


class HostShard:
    """Stage 3 under ``optimizer+params``: this rank's compute-dtype parameter shard lives in host memory.

    ``fetch`` starts its copy to the device as part of the stage-3 prefetch; the device copy is the
    all-gather's input and is dropped with the gather, so the device holds no parameter shard
    between steps. ``update`` (after the host optimizer step) first waits until no copy still reads
    the host buffer.
    """

    location = "host"

    def __init__(self, values: torch.Tensor, *, h2d: HostToDevice) -> None:
        self.tensor = host_empty(values.numel(), values.dtype, device=h2d.device)
        self.tensor.copy_(values)
        self._h2d = h2d
        self._upload: Upload | None = None
        self._last_read: torch.cuda.Event | None = None  # the event only: keeping the Upload would keep its
        # device copy alive until the next update, every block's at once (a whole shard on the device)

    def fetch(self) -> None:
        if self._upload is None:
            self._upload = self._h2d.start(self.tensor)
            self._last_read = self._upload.event

    def take(self) -> torch.Tensor:
        self.fetch()
        upload, self._upload = self._upload, None
        assert upload is not None  # set by fetch
        return upload.ready()

    def drop(self) -> None:
        if self._upload is not None:
            self._upload.ready()  # the allocator may reuse the buffer on the current stream only after the copy
            self._upload = None

    def update(self, lo: int, hi: int, values: torch.Tensor) -> None:
        if self._last_read is not None:
            self._last_read.synchronize()
            self._last_read = None
        self.tensor[lo:hi].copy_(values)

    def held(self) -> Held:
        return Held(host=[self.tensor])


class HostGradShard:
    """ZeRO-Offload's fp32 gradient partition in host memory, one per flat group, filled as buckets finish reducing."""

    def __init__(self, numel: int, *, d2h: DeviceToHost) -> None:
        self.tensor = host_empty(numel, torch.float32, device=d2h.device).zero_()
        self._d2h = d2h

    def direct_out(self, *, fresh: bool, dtype: torch.dtype) -> torch.Tensor | None:
        return None  # the collective writes a transient device buffer, which is then copied out

    def fold(self, out: torch.Tensor, *, fresh: bool) -> None:
        self._d2h.copy(out, self.tensor, accumulate=not fresh)

    def ready(self) -> torch.Tensor:
        self._d2h.drain()
        return self.tensor

    def held(self) -> Held:
        return Held(host=[self.tensor])
