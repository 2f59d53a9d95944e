"""The setups ``zbench tune`` searches: implementation x stage x offload mode x micro-batch x activation
checkpointing, with gradient accumulation holding a global batch when one is given.

Each setup is a traceable ``Case`` at the user's GPU count. What the search leaves out, and why (an
implementation that cannot be traced here, a precision it lacks, a micro-batch the global batch cannot be split
by), is kept as a line for the user rather than dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.plan.trace.plan import case_name, combinations, make_case, taken_options, untraceable
from zbench.suite.preflight import DEEPSPEED

#: Micro-batches tried when none is given: sequences per rank per forward.
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Question:
    """What the user asked: the model, where it trains, and the axes to search."""

    model: str
    gpus: int
    precision: str
    seq_len: int
    implementations: tuple[str, ...]
    offloads: tuple[str, ...]
    micro_batches: tuple[int, ...]
    checkpointing: tuple[bool, ...]
    global_batch_tokens: int | None
    device: str
    options: dict[str, object] = field(default_factory=dict)
    """Implementation options every searched setup gets (``--option``)."""

    def case(
        self,
        name: str,
        stage: int,
        offload: str,
        *,
        micro_batch: int,
        grad_accum: int,
        checkpointing: bool,
        options: dict[str, object],
    ) -> Case:
        """One setup of this question: implementation ``name`` with the given axes, at the question's model, GPUs,
        precision, sequence length and device."""
        case = make_case(
            self.model, name, stage, offload, gpus=self.gpus, precision=self.precision, micro_batch=micro_batch,
            seq_len=self.seq_len, device=self.device, checkpointing=checkpointing, options=options,
        )  # fmt: skip
        return case.model_copy(update={"grad_accum": grad_accum}) if grad_accum > 1 else case


@dataclass
class Space:
    """The cases to trace, and what was left out of the search with the reason."""

    cases: list[Case] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def grad_accum_for(q: Question, micro_batch: int) -> int | None:
    """Micro-batches per step that make ``q``'s global batch at ``micro_batch``, or None when it does not split."""
    if q.global_batch_tokens is None:
        return 1
    per_micro_step = micro_batch * q.seq_len * q.gpus
    if q.global_batch_tokens % per_micro_step:
        return None
    return q.global_batch_tokens // per_micro_step


def search_space(q: Question) -> Space:
    """Every traceable setup of ``q``; the rest in ``left_out``, one line each."""
    space = Space()
    for name, reason in untraceable(q.implementations).items():
        if name != DEEPSPEED:  # estimated from the reference engine's traces (zbench.tune.deepspeed_estimate)
            space.left_out.append(f"{name}: not searched: {reason}")
    names = [n for n in q.implementations if _runs_precision(n, q.precision, space.left_out)]
    accum = {mb: grad_accum_for(q, mb) for mb in q.micro_batches}
    for mb, ga in accum.items():
        if ga is None:
            space.left_out.append(
                f"micro-batch {mb}: the global batch of {q.global_batch_tokens:,} tokens is not a whole number of "
                f"micro-steps of {mb} x {q.seq_len} tokens on {q.gpus} GPUs"
            )
    for name, stage, offload in combinations(names, q.offloads, q.device):
        options = taken_options(name, q.options)
        for mb in q.micro_batches:
            ga = accum[mb]
            if ga is None:
                continue
            for ckpt in q.checkpointing:
                space.cases.append(
                    q.case(name, stage, offload, micro_batch=mb, grad_accum=ga, checkpointing=ckpt, options=options)
                )
    return space


def _runs_precision(name: str, precision: str, left_out: list[str]) -> bool:
    precisions = registry.resolve(name).capabilities.precisions
    if precision in precisions:
        return True
    left_out.append(f"{name}: not searched: it trains in {', '.join(sorted(precisions))}, not {precision}")
    return False


def describe(case: Case) -> str:
    """One setup in a few words: ``zero3 (stage 3) + offload optimizer, micro-batch 4 x 2, checkpointing, prefetch 0``
    (an option only where the setup sets one)."""
    accum = f" x {case.grad_accum}" if case.grad_accum > 1 else ""
    ckpt = ", checkpointing" if case.activation_checkpointing else ""
    return f"{case_name(case)}, micro-batch {case.micro_batch}{accum}{ckpt}{case.options_text}"
