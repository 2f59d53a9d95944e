"""What each built-in implementation's step costs beyond its operators: hooks, wrappers, parameter bookkeeping,
DTensor dispatch, Python between the operators.

The operator model charges each operator its work and a per-call cost measured on a bare ``Linear`` stack
(``kernels.op_call_us``), and nothing else, so an implementation whose hooks do much work in Python (FSDP2's
all-gather copy-in and copy-out around every unit, torch ZeRO's per-parameter broadcasts) is predicted as cheap
as DDP: at ``tiny`` on 2 cores FSDP2's step is 2.4-3.0x DDP's, the operators alone said 1.0-1.4x.

Each implementation trains a narrow GPT (width 32, two heads, vocabulary 128, 32 tokens: every operator's work
negligible) at world 1 in a rank's environment, at two depths. Its residual, the measured step less what its
own operators are charged (the same ledger the trace keeps, at the calibration's costs), is fitted as
``per_step + per_block x blocks``; the simulator adds it to a traced case of the same implementation and stage.
A third, wide probe (width 512, two blocks) is timed too, and every probe's measured step kept: where one
implementation is estimated from another's trace (DeepSpeed from the reference engine's,
``zbench.tune.deepspeed_estimate``) the difference of their measured steps is what the estimate adds, operators and
host work together, and some of it grows with the bytes rather than the modules (on 2 CPU cores DeepSpeed's stage-1
step was 3 ms over the reference engine's at width 32 and 35-115 ms at width 512, six runs, 2026-11-29, where
``small`` and ``medium`` had been predicted 7-13% too fast). The wide probe's remainder beyond its operators and
the narrow fit is mostly the operator model's own error at that width, common to every implementation: DDP's is
taken as that error, and what each implementation's exceeds it by is charged per parameter element
(``per_element_beyond``). Every term is a difference between steps timed seconds apart on a machine whose speed
drifts (on 2 CPU cores a slow spell through the ZeRO family's wide probes once read per-element terms of 4.6-7.5 ns
where other calibrations read 0.35-1.3, 2026-12-01), so each probe's steps alternate with a DDP engine's at the
same shape, round by round (``paired_rounds``), and the probe's step is read as the median of its rounds' ratios
times DDP's median step over the whole calibration (``in_reference_terms``): a spell slows both steps of a round
alike, a burst through one step is one round's outlier.
The probe model is none of the cases a validation predicts: nothing is fitted to them. At world 1 no collective
crosses a link, so what this measures is the host's own work; the links are the collective curves' business.
On a GPU this is not measured (the host's work there overlaps the device's, and the probe would time the
launches instead).
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zbench.cases import registry
from zbench.cases.models import GPT
from zbench.implementations import BUILTIN
from zbench.plan.simulate.calibration import Calibration, ImplementationOverhead, overhead_key
from zbench.plan.simulate.compute import op_seconds
from zbench.plan.trace.ops import OpLedger
from zbench.presets import GPTConfig
from zbench.protocol import TrainSpec

#: The probes as (blocks, width, heads): two narrow depths, whose residuals are fitted, and one wide probe, timed
#: for the measured differences between implementations (head dimension 64, as the presets').
PROBES = ((2, 32, 2), (6, 32, 2), (2, 512, 8))
NARROW = PROBES[0][1]
#: The implementation whose wide-probe remainder is taken as the operator model's own error there (``fit``).
DDP_KEY = overhead_key("ddp", 0)
#: Seconds each probe's paired rounds go on for (at least ``MIN_ROUNDS``), at the narrow and the wide shapes: at
#: 0.3 s of the wide probe alone (three steps of 120-240 ms), DeepSpeed's difference from the reference engine
#: read 57, 115 and 61 ms in three runs (2026-11-29).
NARROW_BUDGET_S, WIDE_BUDGET_S = 0.6, 1.6
MIN_ROUNDS = 5
VOCAB, TOKENS, BATCH = 128, 32, 4


@contextmanager
def _probe_engine(implementation: str, stage: int, blocks: int, width: int, heads: int) -> Iterator[tuple[Any, list]]:
    """One probe's engine, built and warmed (optimizer state, buffers, hooks' first calls), and its batch."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=blocks, d_model=width, heads=heads, vocab=VOCAB, seq=TOKENS))
    spec = TrainSpec(device=torch.device("cpu"), stage=stage, lr=1e-4, options=_probe_options(implementation, model))
    engine = registry.resolve(implementation).build(model, spec, dist.group.WORLD)
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS + 1))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    try:
        for _ in range(3):
            engine.step(batch)
        yield engine, batch
    finally:
        engine.close()


def _step_ops(engine: Any, batch: list) -> list[dict[str, Any]]:
    ledger = OpLedger()
    with ledger:
        ledger.start_step()
        engine.step(batch)
        return [e for entries in ledger.take().values() for e in entries]


def _one(
    implementation: str, stage: int, shape: tuple[int, int, int], reference: Callable[[], object], budget_s: float
) -> dict[str, Any]:
    """Build and warm one probe, record the operators of one step, then time its steps alternating with
    ``reference`` (DDP's step at the same shape, ``paired_rounds``): each round's step and reference seconds."""
    blocks, width, heads = shape
    with _probe_engine(implementation, stage, blocks, width, heads) as (engine, batch):
        ops = _step_ops(engine, batch)
        rounds = paired_rounds(lambda: engine.step(batch), reference, budget_s)
    return {"key": overhead_key(implementation, stage), "blocks": blocks, "width": width, "rounds": rounds,
            "ops": ops}  # fmt: skip


def paired_rounds(
    step: Callable[[], object],
    reference: Callable[[], object],
    budget_s: float,
    *,
    min_rounds: int = MIN_ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple[float, float]]:
    """``(step seconds, reference seconds)`` of each round: one call of each, back to back, the order alternating
    from round to round (whichever runs second finds the other's freed memory and warm caches); rounds until
    ``budget_s`` has passed and at least ``min_rounds`` ran."""
    pair = (step, reference)
    rounds: list[tuple[float, float]] = []
    started = clock()
    while len(rounds) < min_rounds or clock() - started < budget_s:
        seconds = [0.0, 0.0]
        for i in (0, 1) if len(rounds) % 2 == 0 else (1, 0):
            begin = clock()
            pair[i]()
            seconds[i] = clock() - begin
        rounds.append((seconds[0], seconds[1]))
    return rounds


def in_reference_terms(probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each probe's ``seconds``: the median of its rounds' step-over-reference ratios times the median reference
    step at its shape over every probe's rounds, i.e. its step as it would have read beside DDP's typical step
    this calibration (DDP's own probe, paired with a second DDP engine, reads about that step)."""
    reference: dict[tuple[int, int], list[float]] = {}
    for p in probes:
        reference.setdefault((p["blocks"], p["width"]), []).extend(theirs for _, theirs in p["rounds"])
    typical = {shape: statistics.median(times) for shape, times in reference.items()}
    return [
        {**p, "seconds": statistics.median(mine / theirs for mine, theirs in p["rounds"])
                         * typical[(p["blocks"], p["width"])]}
        for p in probes
    ]  # fmt: skip


def probe_ops(implementation: str, stage: int, blocks: int, width: int, heads: int) -> list[dict[str, Any]]:
    """One step's operators of a probe, untimed, as ``_one`` records them (in a process group, e.g. of one): what
    re-fitting a stored profile's probes needs (``tests/benchmarks/bandwidth_models.py``)."""
    with _probe_engine(implementation, stage, blocks, width, heads) as (engine, batch):
        return _step_ops(engine, batch)


def _probe_options(implementation: str, model: torch.nn.Module) -> dict[str, Any]:
    """DeepSpeed's buckets sized to the probe model: at the harness's 50M elements its stages 1-2 allocate a
    200 MB bucket each step that the probe's gradients barely touch, which the operator ledger would charge as
    200 MB of fresh pages (40 ms here, eight times the measured step) and the fit would read as negative host
    work."""
    if implementation != "deepspeed":
        return {}
    elements = sum(p.numel() for p in model.parameters())
    return {"config": {"zero_optimization": {"reduce_bucket_size": elements, "allgather_bucket_size": elements}}}


def probed() -> list[tuple[str, int]]:
    """The built-ins probed, each at every stage it runs (read off its capabilities, so that a stage added to an
    implementation is probed with it: FSDP2's stage 2 was charged no host work until it was), less what cannot
    run on this install. DeepSpeed, which ``zbench tune`` estimates from the reference engine's traces, is probed
    where it is installed, so that its estimate carries DeepSpeed's own host work rather than the stand-in's
    (``zbench.tune.deepspeed_estimate``)."""
    out = []
    for name in sorted(BUILTIN):
        caps = registry.resolve(name).capabilities
        if caps.missing is None:
            out += [(name, stage) for stage in sorted(caps.stages)]
    return out


def probe(progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every implementation at every probe shape, in a process group of one (run in a rank's environment:
    ``rank_probes``), each paired round by round with a DDP engine at its shape (``paired_rounds``) and read in
    the reference's terms (``in_reference_terms``)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        with ExitStack() as stack:
            reference = {shape: stack.enter_context(_probe_engine("ddp", 0, *shape)) for shape in PROBES}
            runs = probed()
            probes = []
            for i, (impl, stage) in enumerate(runs, 1):
                progress(f"host work beside DDP's: {overhead_key(impl, stage)} ({i}/{len(runs)})")
                probes += [
                    _one(impl, stage, shape, _stepper(*reference[shape]),
                         WIDE_BUDGET_S if shape == PROBES[-1] else NARROW_BUDGET_S)
                    for shape in PROBES
                ]  # fmt: skip
        return in_reference_terms(probes)
    finally:
        dist.destroy_process_group()


def _stepper(engine: Any, batch: list) -> Callable[[], object]:
    """One step of a reference engine, bound now (a lambda in ``probe``'s loop would bind its last shape's)."""
    return lambda: engine.step(batch)


def fit(probes: list[dict[str, Any]], cal: Calibration) -> dict[str, ImplementationOverhead]:
    """Each implementation's residual at the narrow probes, as ``per_step + per_block x blocks`` through the two,
    and what its wide probe leaves beyond that and beyond DDP's, per parameter element (``per_element_beyond``);
    every probe's measured step kept beside it."""
    residuals: dict[str, dict[int, float]] = {}
    wide: dict[str, tuple[int, float]] = {}
    measured: dict[str, dict[str, float]] = {}
    for p in probes:
        measured.setdefault(p["key"], {})[label(p["blocks"], p["width"])] = p["seconds"] * 1e6
        residual = p["seconds"] - sum(op_seconds(e, cal, on_gpu=False) for e in p["ops"])
        if p["width"] == NARROW:
            residuals.setdefault(p["key"], {})[p["blocks"]] = residual
        else:
            wide[p["key"]] = (p["blocks"], residual)
    narrow = {name: _through_two(by_depth) for name, by_depth in residuals.items()}
    beyond = {
        name: residual - (narrow[name][0] + narrow[name][1] * blocks)
        for name, (blocks, residual) in wide.items() if name in narrow
    }  # fmt: skip
    _, wide_elements = probe_shapes()[label(*PROBES[-1][:2])]
    per_element = per_element_beyond(beyond, DDP_KEY, wide_elements)
    return {
        name: ImplementationOverhead(
            per_step_us=per_step * 1e6,
            per_block_us=per_block * 1e6,
            per_element_us=per_element.get(name, 0.0) * 1e6,
            residuals_us={str(d): r * 1e6 for d, r in sorted(residuals[name].items())},
            measured_us=measured[name],
        )
        for name, (per_step, per_block) in narrow.items()
    }


def _through_two(by_depth: dict[int, float]) -> tuple[float, float]:
    """``(per_step, per_block)`` seconds of the line through the residuals at the two narrow depths."""
    (few, r_few), (many, r_many) = sorted(by_depth.items())
    per_block = (r_many - r_few) / (many - few)
    return r_few - per_block * few, per_block


def per_element_beyond(beyond: dict[str, float], reference: str, elements: int) -> dict[str, float]:
    """Seconds per parameter element each implementation's wide probe took beyond its operators and its narrow
    fit, over what the ``reference`` implementation's (DDP's) took beyond its own: that common remainder is the
    operator model's error at the wide probe's shapes, which every implementation's operators share, and what is
    left over it grows with the parameters' bytes rather than with the modules (FSDP2's copies into and out of its
    all-gather and reduce-scatter buffers and their fresh pages, outside the traced operators: on 2 CPU cores its
    wide probe was 4-24 ms over DDP's remainder in six calibrations of 2026-11-30, where its ratio to DDP had been
    predicted up to 17% low at ``small`` and ``medium``; docs/methods.md, the eleventh validation pass). Signed:
    an implementation that does less per byte than DDP's reducer reads below it. Empty where the reference was not
    probed."""
    if reference not in beyond:
        return {}
    return {name: (seconds - beyond[reference]) / elements for name, seconds in beyond.items()}


def step_difference(mine: ImplementationOverhead, other: ImplementationOverhead) -> tuple[float, float, float] | None:
    """``mine``'s measured probe steps over ``other``'s as seconds per step, per block and per parameter element,
    solved exactly through the probes (three probes, three terms); ``None`` where either kept no step for some
    probe (a profile from before schema 4)."""
    shapes = probe_shapes()
    if not all(set(o.measured_us) >= set(shapes) for o in (mine, other)):
        return None
    probes = np.array([[1.0, blocks, elements] for blocks, elements in shapes.values()])
    over = np.array([mine.measured_us[k] - other.measured_us[k] for k in shapes]) * 1e-6
    per_step, per_block, per_element = np.linalg.solve(probes, over)
    return float(per_step), float(per_block), float(per_element)


def label(blocks: int, width: int) -> str:
    """A probe's key in ``measured_us``: its depth at the narrow width (as ``residuals_us`` keys them), else
    ``DxW``."""
    return str(blocks) if width == NARROW else f"{blocks}x{width}"


def probe_shapes() -> dict[str, tuple[int, int]]:
    """Each probe's ``measured_us`` key, and its model's blocks and parameter elements (what ``_one`` builds)."""
    return {
        label(blocks, width): (blocks, GPTConfig(layers=blocks, d_model=width, heads=heads, vocab=VOCAB,
                                                 seq=TOKENS).num_parameters)
        for blocks, width, heads in PROBES
    }  # fmt: skip
