"""Deliberately wrong implementations: the bugs zbench's equivalence verdict must catch.

Each bug is one small, realistic mistake, named after what a reviewer would call it. They come in
two families:

- ``MANUAL``: a hand-rolled data-parallel trainer (replicated model, gradients all-reduced after
  backward, the suite's optimizer) that is correct unless its ``bug`` option names a mistake. Its
  correct form is a control: the harness must judge it equivalent, so that every catch below is
  the bug's doing, not the hand-rolled loop's.
- ``ZERO``: our reference ZeRO engine (stage from the ``stage`` option) with one of its parts
  patched wrong at build time (only inside the rank that builds it).

Every engine reports what it really computed (its own gradient norm), as an honest buggy engine would.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zbench.implementations import zero as zero_impl
from zbench.implementations.zero import engine as zero_engine
from zbench.implementations.zero import masters as zero_masters
from zbench.implementations.zero import optim as zero_optim
from zbench.implementations.zero import params as zero_params
from zbench.protocol import Capabilities, EngineBase, ImplementationBase, MicroBatch, TrainSpec
from zbench.state_bytes import module_state_bytes

MANUAL_BUGS = {
    "none": "correct (control)",
    "grad_sum": "sums gradients across ranks instead of averaging them",
    "accum_double_div": "divides accumulated gradients by the micro-batch count twice",
    "loss_scale_kept": "scales the loss by 128 and never unscales the gradients",
    "clip_local_norm": "clips with this rank's gradient norm before the all-reduce",
    "lr_high_late": "learning rate too high from step 10 (a scheduler stepped twice): x1.1, or option lr_factor",
    "wd_skips_norms": "skips weight decay on LayerNorm parameters",
    "unsynced_step": "forgets the gradient all-reduce on step 5",
    "stale_grad": "steps on the previous step's gradient from step 5 on (a gradient buffer one step late)",
    "rank_lr": "rank 1 uses a 1% higher learning rate (ranks drift apart)",
    # three bugs whose effect lies inside bf16's rounding noise (issue 32): only the fp32 probe sees them in bf16
    "lr_tiny_late": "learning rate 0.1% too high from step 10",
    "wd_skips_biases_norms": "skips weight decay on biases and LayerNorm parameters",
    "stale_grad_one_tensor": "the final LayerNorm weight steps on the previous step's gradient from step 5",
}
ZERO_BUGS = {
    "none": "correct (control)",
    "zero_grad_sum": "ZeRO reduce-scatter without dividing by the world size",
    "zero_bf16_master": "keeps master weights (and so optimizer state) in bf16",
    "zero_stale_gather": "stage 3 skips re-gathering the updated root unit (stale parameters after step 1)",
    "zero_clip_local": "global norm computed without the all-reduce (each rank clips by its own shard)",
}
#: Bugs of a mixture-of-experts model's idle experts (the ``moe-tiny`` preset; tests/test_moe.py).
MOE_BUGS = {
    "zero_idle_expert_stepped": "an expert no rank used is stepped with a zero gradient (decayed, moved by its "
    "momentum) where DDP's AdamW skips it",
    "zero_expert_grad_dropped": "rank 1 drops the last expert's gradient (as if no token had reached it)",
}


class ManualDPEngine(EngineBase):
    """A replicated data-parallel trainer written out by hand, with one optional bug."""

    def __init__(self, model: nn.Module, spec: TrainSpec, group: dist.ProcessGroup | None, bug: str) -> None:
        self.model, self.spec, self.group, self.bug = model, spec, group, bug
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.optimizer = self._optimizer()
        self.steps = 0
        self.previous: list[torch.Tensor] | None = None
        self.grad_norm = torch.zeros(())

    def _optimizer(self) -> torch.optim.Optimizer:
        cls, kwargs = self.spec.optimizer_class_and_kwargs()
        params = list(self.model.named_parameters())
        if self.bug == "rank_lr" and self.rank == 1:
            kwargs["lr"] *= 1.01
        if self.bug in ("wd_skips_norms", "wd_skips_biases_norms"):
            biases = self.bug == "wd_skips_biases_norms"

            def skipped(name: str) -> bool:
                return ".ln" in name or name.startswith("ln") or (biases and name.endswith(".bias"))

            rest = [p for n, p in params if not skipped(n)]
            return cls(
                [{"params": rest}, {"params": [p for n, p in params if skipped(n)], "weight_decay": 0.0}], **kwargs
            )
        return cls([p for _, p in params], **kwargs)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.spec.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.spec.device.type, dtype=self.spec.compute_dtype)

    def step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        n = len(micro_batches)
        divide = n * n if self.bug == "accum_double_div" and n > 1 else n
        scale = 128.0 if self.bug == "loss_scale_kept" else 1.0
        total = torch.zeros(())
        for batch in micro_batches:
            with self._autocast():
                loss = self.model(*batch)
            (loss * scale / divide).backward()
            total += loss.detach().float()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.bug == "clip_local_norm" and self.spec.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.spec.grad_clip)
        if not (self.bug == "unsynced_step" and self.steps == 5):
            for p in params:
                dist.all_reduce(p.grad, group=self.group)
                if self.bug != "grad_sum":
                    p.grad /= self.world
        if self.bug in ("stale_grad", "stale_grad_one_tensor"):
            late = params if self.bug == "stale_grad" else [dict(self.model.named_parameters())["ln.weight"]]
            current = [p.grad.clone() for p in late]
            if self.steps >= 5 and self.previous is not None:
                for p, g in zip(late, self.previous):
                    p.grad.copy_(g)
            self.previous = current
        self.grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.spec.grad_clip is not None and self.bug != "clip_local_norm":
            torch.nn.utils.clip_grads_with_norm_(params, self.spec.grad_clip, self.grad_norm)
        if self.bug in ("lr_high_late", "lr_tiny_late") and self.steps == 10:
            factor = 1.001 if self.bug == "lr_tiny_late" else float(self.spec.options.get("lr_factor", 1.1))
            for g in self.optimizer.param_groups:
                g["lr"] *= factor
        self.optimizer.step()
        self.steps += 1
        return total / n

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in self.model.named_parameters()}

    def state_bytes(self) -> dict[str, dict[str, int]]:
        return module_state_bytes(self.model.parameters(), self.optimizer, compute_device=self.spec.device)

    def metrics(self) -> dict[str, float]:
        return {"grad_norm": float(self.grad_norm)}


class Manual(ImplementationBase):
    name = "manual_dp"
    capabilities = Capabilities(stages=frozenset({0}), precisions=frozenset({"fp32", "bf16"}))

    def build(self, model: nn.Module, spec: TrainSpec, group: dist.ProcessGroup | None) -> ManualDPEngine:
        bug = spec.options.get("bug", "none")
        if bug not in MANUAL_BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {', '.join(MANUAL_BUGS)}")
        return ManualDPEngine(model, spec, group, bug)


@contextlib.contextmanager
def _patched(owner: Any, name: str, replacement: Callable) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _summing_step(step: Callable) -> Callable:
    """The optimizer receives the group sum of the gradients instead of their mean."""

    def summed(self: zero_optim.ShardedOptimizer, grads: list[torch.Tensor], **kwargs: Any) -> bool:
        for g in grads:
            g.mul_(self.comm.world)
        return step(self, grads, **kwargs)

    return summed


def _bf16_master(shard: torch.Tensor, fp32_values: torch.Tensor) -> torch.Tensor:
    return fp32_values.to(torch.bfloat16)


def _casting_step(step: Callable) -> Callable:
    """The master store handed bf16 masters: gradients cast to their dtype."""

    def cast(self: zero_masters.InMemoryMasters, grads: list[torch.Tensor], **kwargs: Any) -> None:
        masters = list(self.masters())
        return step(self, [g.to(m.dtype) for g, m in zip(grads, masters)], **kwargs)

    return cast


def _upcasting_gather(gather: Callable) -> Callable:
    """The full-parameter gather reads the bf16 masters as fp32 (so that the bug shows in training, not here)."""

    def upcast(layouts: Any, masters: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        return gather(layouts, [m.float() for m in masters], **kwargs)

    return upcast


def _local_norm(self: zero_optim.ShardedOptimizer, grads: list[torch.Tensor]) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        sq += torch.linalg.vector_norm(g) ** 2
    return sq.sqrt()


class Zero(ImplementationBase):
    """Our ZeRO engine with one part patched wrong while it is built (the patches act through the built objects)."""

    name = "zero_wrong"

    def __init__(self) -> None:
        self.capabilities = Capabilities(
            stages=frozenset({1, 2, 3}), precisions=frozenset({"fp32", "bf16"}), keeps_master_weights=True
        )

    def build(self, model: nn.Module, spec: TrainSpec, group: dist.ProcessGroup | None) -> Any:
        bug = spec.options.get("bug", "none")
        if bug not in ZERO_BUGS | MOE_BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {', '.join(ZERO_BUGS | MOE_BUGS)}")
        spec = dataclasses.replace(spec, options={k: v for k, v in spec.options.items() if k != "bug"})
        stage = spec.stage
        factory = {1: zero_impl.ZeRO1Engine, 2: zero_impl.ZeRO2Engine, 3: zero_impl.ZeRO3Engine}[stage]
        if bug == "zero_grad_sum":
            # this rank's process only: the bug lasts the whole run
            zero_optim.ShardedOptimizer.step = _summing_step(zero_optim.ShardedOptimizer.step)  # type: ignore[method-assign]
        if bug == "zero_clip_local":
            zero_optim.ShardedOptimizer._global_norm = _local_norm  # type: ignore[method-assign]
        with contextlib.ExitStack() as stack:
            if bug == "zero_bf16_master":
                stack.enter_context(_patched(zero_params, "_master", _bf16_master))
                zero_masters.InMemoryMasters.step = _casting_step(zero_masters.InMemoryMasters.step)  # type: ignore[method-assign]
                zero_engine.gather_full_parameters = _upcasting_gather(zero_engine.gather_full_parameters)
            engine = factory(model, spec, group)
        if bug == "zero_stale_gather":
            if stage != 3:
                raise ValueError("zero_stale_gather is a stage-3 bug")
            _make_root_stale(engine)
        if bug in MOE_BUGS and engine.usage is None:
            raise ValueError(f"{bug} needs a model with experts (moe-tiny)")
        if bug == "zero_idle_expert_stepped":
            engine.usage.skipped = lambda: [set() for _ in engine.buckets]  # nothing is ever skipped
        if bug == "zero_expert_grad_dropped" and dist.get_rank() == 1:
            _drop_last_expert(engine)
        return engine


def _drop_last_expert(engine: Any) -> None:
    """Every bucket treats the last expert's gradients as if backward had not reached them (zeros reduced)."""
    for bucket in engine.buckets:
        bucket.add = _dropping(bucket, {i for i, name in enumerate(bucket.layout.names) if ".experts.3." in name})


def _dropping(bucket: Any, dropped: set[int]) -> Callable[[int, torch.Tensor], None]:
    add = bucket.add

    def dropping(index: int, param: torch.Tensor) -> None:
        if index in dropped:
            param.grad = None
            bucket.mark_unused(index)
        else:
            add(index, param)

    return dropping


def _make_root_stale(engine: Any) -> None:
    """After the first step, the root unit's gathered parameters are kept and never refreshed from the shards."""
    root, bucket = engine.root, engine.buckets[0]
    original_reshard = root.reshard
    state = {"steps": 0}
    step = engine.step

    def reshard() -> None:
        if state["steps"] >= 1:
            return  # keeps the full parameters gathered at step 2 forever: later updates never reach them
        original_reshard()

    def counting_step(micro_batches: list[MicroBatch]) -> torch.Tensor:
        loss = step(micro_batches)
        state["steps"] += 1
        bucket._on_launch = None
        return loss

    root.reshard = reshard
    engine.step = counting_step


MANUAL = Manual()
ZERO = Zero()
