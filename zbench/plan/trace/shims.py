"""Where torch.distributed needs real data or a real network even when every tensor is fake, patched while tracing.

``fake_world`` joins this process to a ``fake`` process group of any size (every
collective returns at once, moving nothing) and, for as long as it is open,
replaces the pieces of torch whose job is bookkeeping on real values or
waiting on a network, not the training step being traced:

- ``DeviceMesh.from_group`` (FSDP2) builds a tensor of rank ids and reads it back
  with ``tolist()``; under ``FakeTensorMode`` that tensor has no values, so it is
  built outside the fake mode (a few integers, not model state);
- DDP's start-up check that every rank holds the same parameter shapes reads
  parameter bytes; with one real rank in a fake group there is nothing to compare,
  so it is skipped;
- DDP's reducer expects its all-reduce to hand back the bucket; the fake group's
  future carries nothing, so each DDP built meanwhile gets a communication hook
  that does what the built-in one does (divide by the world size, all-reduce the
  bucket in place, hand the bucket back) through ``dist.all_reduce``, which the
  communication ledger counts as it counts the built-in hook;
- DDP's first step runs with one bucket holding every gradient; before its second
  it rebuilds them (1 MB first, then 25 MB each) in the order gradients arrived,
  agreeing on that order across ranks by writing integers into a tensor. A fake
  tensor has nowhere to write them, so a traced DDP gets buckets of the rebuilt
  sizes from the start, in reverse declaration order (DDP's own approximation of
  gradient order), and keeps them: the same gradients in the same bytes and about
  as many all-reduces (a boundary can fall elsewhere, docs/methods.md#tracing);
- a fake collective is done at once, but its handle's ``is_completed()`` says
  False for ever; an implementation that polls it to free a buffer early (the
  reference engine's gradient buckets) would hold every buffer to the end, so
  it says True, as a real handle does once the network has delivered;
- FSDP2 shards each parameter with ``torch.chunk(param, world)`` and keeps two of the
  chunks (this rank's and the first, which sets the padding): at 1,024 ranks that
  is 1,024 fake views per call, two calls per parameter (two minutes of a 70B
  trace). The chunks are made on demand instead, by the same ``narrow`` that
  ``torch.chunk`` does: the same tensors for the chunks FSDP2 reads;
- FSDP1 asks whether a flat parameter's storage is allocated, and whether two tensors share
  one, by their data pointers, which are 0 for every fake tensor; it is asked of the
  storage itself instead (its size, its identity): the same answers for real tensors;
- mirroring gloo, a reduce-scatter also makes the scratch gloo makes: gloo reduces a
  copy of the whole input and, on the calling thread when the collective completes,
  copies this rank's part out of it (measured: a 100,000-byte input shows 100,000
  bytes more live, docs/methods.md#tracing). NCCL needs no such copy.

Everything else (the model's build, the engines' sharding, forward, backward,
optimizer step, offload copies) runs unchanged.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, overload

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.distributed.fsdp._flat_param as flat_param_module
import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param_module
import torch.nn.parallel.distributed as ddp_module
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh


def _allreduce_bucket(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default hook, written against the fake group: average the bucket in place and hand it back."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None  # async_op=True always returns the work
    return work.get_future().then(lambda _: buffer)


# DDP checks the hook's annotation against the class itself, not the string ``from __future__`` leaves
_allreduce_bucket.__annotations__["bucket"] = dist.GradBucket
_allreduce_bucket.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _rebuilt_bucket_limits(bucket_cap_mb: float | None) -> list[int]:
    """The bucket caps DDP rebuilds its buckets with (1 MB first, then ``bucket_cap_mb`` each; a cap given
    explicitly applies to the first bucket too), worked out from DDP's argument as DDP itself does. Read from the
    argument, not from DDP's attributes, which moved between torch releases (2.13 keeps them in a config object)."""
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    return [first, cap] if first < cap else [cap]


def _buckets_as_rebuilt(ddp_init: Callable[..., None]) -> Callable[..., None]:
    """``DistributedDataParallel.__init__`` that assigns its first buckets with the rebuilt caps (and, since the
    reducer's replies carry nothing, hooks the all-reduce and keeps the buckets; see the module's docstring)."""
    signature = inspect.signature(ddp_init)
    assign = dist._compute_bucket_assignment_by_size

    def init(self: ddp_module.DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(self, *args, **kwargs).arguments
        limits = _rebuilt_bucket_limits(arguments.get("bucket_cap_mb"))
        if arguments.get("bucket_cap_mb_list"):  # caps per bucket, given: DDP uses them from its first step
            ddp_init(self, *args, **kwargs)
        else:
            with patched(
                dist, "_compute_bucket_assignment_by_size", lambda params, _, *rest: assign(params, limits, *rest)
            ):
                ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, _allreduce_bucket)
        self.reducer = _KeepBuckets(self.reducer)  # type: ignore[assignment]  # a proxy for DDP's Python side

    return init


class _KeepBuckets:
    """DDP's reducer as DDP's Python code sees it, minus the bucket rebuild (C++ keeps the real reducer)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


class _LazyChunks(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n``, each chunk made when it is read."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        length = tensor.size(dim)
        self.size = math.ceil(length / num_chunks)
        # torch.chunk returns ceil(length / size) chunks, or num_chunks empty ones of an empty tensor
        self.produced = math.ceil(length / self.size) if length else num_chunks

    def __len__(self) -> int:
        return self.num_chunks

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        if not -self.num_chunks <= i < self.num_chunks:
            raise IndexError(i)
        i %= self.num_chunks
        if i >= self.produced:  # _chunk_with_empty's padding
            return self[0].new_empty(0)
        start = i * self.size
        return self.tensor.narrow(self.dim, start, min(self.size, self.tensor.size(self.dim) - start))


def _storage_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _with_gloo_scratch(reduce_scatter: Any) -> Any:
    """``reduce_scatter_single`` as gloo runs it, memory-wise: a scratch of the input's size when it completes."""

    def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = reduce_scatter(output, input, *args, **kwargs)
        torch.empty_like(input)  # alive for a moment, as gloo's is while this rank's part is copied out
        return work

    return call


@contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def fake_world(world: int, rank: int = 0, *, backend: str = "nccl") -> Iterator[None]:
    """A fake process group of ``world`` ranks, this process being ``rank``, with the patches above.

    ``dist.get_backend`` answers ``backend`` meanwhile: an implementation that takes another path per
    backend (the reference engine builds gloo's reduce-scatter from an all-reduce) takes the one it would
    take there. ``nccl`` traces what GPUs run; ``gloo`` what a CPU run does (how traces are validated).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; tracing needs its own")
    mesh_from_group = DeviceMesh.from_group

    def real_mesh(*args: Any, **kwargs: Any) -> DeviceMesh:
        with unset_fake_temporarily():
            return mesh_from_group(*args, **kwargs)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with (
            patched(DeviceMesh, "from_group", staticmethod(real_mesh)),
            patched(ddp_module, "_verify_param_shape_across_processes", lambda *a, **k: None),
            patched(
                ddp_module.DistributedDataParallel,
                "__init__",
                _buckets_as_rebuilt(ddp_module.DistributedDataParallel.__init__),
            ),
            patched(dist, "get_backend", lambda group=None: backend),
            patched(dist.Work, "is_completed", lambda self: True),
            patched(fsdp_param_module, "_chunk_with_empty", _LazyChunks),
            patched(flat_param_module, "_data_ptr_allocated", _storage_allocated),
            patched(flat_param_module, "_same_storage", _same_storage),
            ExitStack() as gloo,
        ):
            if backend == "gloo":  # torch.distributed re-exports distributed_c10d's function: patch both names
                name = "reduce_scatter_single" if hasattr(c10d, "reduce_scatter_single") else "reduce_scatter_tensor"
                scratch = _with_gloo_scratch(getattr(c10d, name))  # (reduce_scatter_single is new in torch 2.13)
                gloo.enter_context(patched(c10d, name, scratch))
                gloo.enter_context(patched(dist, name, scratch))
            yield
    finally:
        dist.destroy_process_group()


def _wait_then_done(work: dist.Work) -> bool:
    work.wait()
    return True


@contextmanager
def instant_network() -> Iterator[None]:
    """A real process group on the trace's schedule: a collective's first poll waits for it and says done.

    A fake collective is done when issued, so a trace frees a buffer at the first ``is_completed()``
    poll; on a real network the poll may say "not yet" and the buffer lives on. Validating the trace's
    accounting against a real run therefore runs the real group with this patch, which changes when
    buffers are freed and nothing else (the bytes, the collectives and their order are the engine's).
    """
    with patched(dist.Work, "is_completed", _wait_then_done):
        yield
