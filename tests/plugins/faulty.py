"""Implementations that are wrong on purpose, used only by the tests to prove the harness catches them.

``FAULTY`` behaves like DDP unless its suite options ask for a fault:

- ``unsynced`` forgets to average one parameter's gradient across ranks (a
  classic hook bug: training goes on, quietly wrong);
- ``crash`` raises on rank 1; ``oom`` asks for an impossible allocation;
- ``hang`` leaves rank 1 asleep so rank 0 blocks in a collective;
- ``sigkill`` kills rank 1 by a signal; ``abort_at_exit`` aborts rank 1 at
  interpreter exit, while rank 0 lingers in its teardown until the agent stops it;
- ``sigkill_marked`` kills, at step 3, every rank started where
  ``$ZBENCH_TEST_KILL_HERE`` names a file (the test sets it on one "node" of a
  multi-node run), after writing its rank there;
- ``slow`` sleeps, after each step, ``$ZBENCH_TEST_SLOWDOWN_PCT`` percent of
  the time the step took (a build that is that much slower, loaded machine or not).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from zbench.implementations.ddp import DDPEngine
from zbench.protocol import Capabilities, EngineBase, ImplementationBase, TrainSpec
from zbench.state_bytes import module_state_bytes


class UnsyncedEngine(EngineBase):
    """Averages every gradient but the last parameter's across ranks."""

    def __init__(self, model: nn.Module, spec: TrainSpec) -> None:
        self.model, self.spec = model, spec
        for p in model.parameters():
            dist.broadcast(p.data, 0)
        self.optimizer = spec.make_optimizer(model.parameters())

    def step(self, micro_batches):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(*micro_batches[0])
        loss.backward()
        params = list(self.model.parameters())
        for p in params[:-1]:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.optimizer.step()
        return loss.detach()

    def full_parameters(self):
        return {n: p.detach().float().cpu().clone() for n, p in self.model.named_parameters()}

    def state_bytes(self):
        return module_state_bytes(self.model.parameters(), self.optimizer, compute_device=self.spec.device)


class FaultyEngine(DDPEngine):
    def __init__(self, model: nn.Module, spec: TrainSpec, group) -> None:
        super().__init__(model, spec, group)
        self.fault = spec.options.get("fault")
        self.steps = 0
        # not in a trace (`zbench report --simulate` builds the engine on fake tensors in its own process, and would
        # wait out the linger there)
        launched = not any(isinstance(p, FakeTensor) for p in model.parameters())
        if self.fault == "abort_at_exit" and launched and dist.get_rank() == 1:
            # crashes while the process group is torn down, after the worker has handed back its results
            dist.destroy_process_group = lambda *args, **kwargs: os.abort()
        elif self.fault == "abort_at_exit" and launched:
            # the peer lingers in its own teardown, so the agent's SIGTERM (it stops the peers of a rank that died)
            # always finds it there, as it does by chance on a loaded machine: a stop, not a crash of its own
            teardown = dist.destroy_process_group
            dist.destroy_process_group = lambda *args, **kwargs: (time.sleep(60), teardown(*args, **kwargs))

    def step(self, micro_batches):
        self.steps += 1
        rank = dist.get_rank()
        if self.steps == 3 and rank == dist.get_world_size() - 1:
            if self.fault == "crash":
                raise RuntimeError("injected failure on purpose")
            if self.fault == "oom":
                torch.empty(2**62, dtype=torch.uint8)
            if self.fault == "hang":
                time.sleep(3600)
            if self.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
        marked = os.environ.get("ZBENCH_TEST_KILL_HERE")
        if self.fault == "sigkill_marked" and self.steps == 3 and marked:
            with open(marked, "w") as f:
                f.write(str(rank))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault != "slow":
            return super().step(micro_batches)
        # slowed only when the test sets the variable: the same suite, a slower build
        start = time.perf_counter()
        loss = super().step(micro_batches)
        pct = float(os.environ.get("ZBENCH_TEST_SLOWDOWN_PCT", "0"))
        if pct:  # no sleep(0) when not slowed: it yields the core, which a loaded machine makes cost a time slice
            time.sleep((time.perf_counter() - start) * pct / 100)
        return loss


class Faulty(ImplementationBase):
    name = "faulty"
    capabilities = Capabilities(stages=frozenset({0}), precisions=frozenset({"fp32"}))

    def build(self, model: nn.Module, spec: TrainSpec, group):
        if spec.options.get("fault") == "unsynced":
            return UnsyncedEngine(model, spec)
        return FaultyEngine(model, spec, group)


FAULTY = Faulty()
