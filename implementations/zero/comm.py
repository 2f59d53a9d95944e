"""The four collectives the stages use, over one process group; a world of one needs no group at all."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from zbench.comm_labels import recorded_as
from zbench.state_bytes import same_memory

# torch 2.13 renamed the single-tensor collectives; older releases only have the first names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle(Protocol):
    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class _Done:
    """The handle of a collective that already finished (synchronous, or a world of one)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


DONE: Handle = _Done()


class _SliceOnWait:
    """An in-place all-reduce that, once waited for, leaves this rank's slice of the sum in ``out``."""

    def __init__(self, work: Handle, out: torch.Tensor, mine: torch.Tensor) -> None:
        self.work, self.out, self.mine = work, out, mine

    def wait(self) -> None:
        self.work.wait()
        if not same_memory(self.out, self.mine):
            self.out.copy_(self.mine)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Comm:
    """This rank's place in the data-parallel group and the collectives over it.

    Flat buffers are laid out rank-major: rank ``r`` owns elements ``[r*S, (r+1)*S)`` of a buffer of
    ``world*S``, which is exactly what ``reduce_scatter`` writes and ``all_gather`` reads.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        if dist.is_available() and dist.is_initialized():
            self.group = group if group is not None else dist.group.WORLD
            self.world = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
            self.backend = str(dist.get_backend(self.group))
        elif group is None:
            self.group, self.world, self.rank, self.backend = None, 1, 0, "none"
        else:
            raise ValueError("a process group was given but torch.distributed is not initialized")

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False, scratch: bool = False
    ) -> Handle:
        """Sum ``inp`` (``world * out.numel()`` elements) over the group; this rank's slice lands in ``out``.

        ``out`` may be this rank's own slice of ``inp`` (in place). ``scratch`` says the caller will
        not read the rest of ``inp`` afterwards, so the collective may overwrite it.

        Note: gloo has no reduce-scatter of its own: ProcessGroupGloo clones the input on the
        calling thread, all-reduces the clone and copies this rank's chunk out. For a scratch input
        we all-reduce it in place and copy the chunk ourselves: the same algorithm and bytes on the
        wire, without a full-size copy on the training thread.
        """
        if self.world == 1:
            if not same_memory(out, inp):
                out.copy_(inp)
            return DONE
        if scratch and self.backend == "gloo":
            n = out.numel()
            with recorded_as("reduce_scatter", inp.numel()):
                work = dist.all_reduce(inp, group=self.group, async_op=True)
            handle: Handle = _SliceOnWait(work, out, inp[self.rank * n : (self.rank + 1) * n])
        else:
            handle = _reduce_scatter(out, inp, group=self.group, async_op=True)
        if not async_op:
            handle.wait()
            return DONE
        return handle

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Every rank's ``inp`` concatenated in rank order into ``out``; ``inp`` may be this rank's slice of ``out``.

        Note: on gloo, one in-place broadcast per rank is about twice as fast as gloo's all-gather
        (which receives into a temporary and copies out), but with those broadcasts in flight a
        rank exited with SIGABRT ("terminate called without an active exception") in about one run
        in four at world 3, so the plain all-gather it is.
        """
        if self.world == 1:
            if not same_memory(out, inp):
                out.copy_(inp)
            return DONE
        work = _all_gather(out, inp, group=self.group, async_op=async_op)
        return work if async_op else DONE

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)
