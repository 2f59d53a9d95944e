"""``zbench tune``'s second pass: the options each implementation declares worth searching (``Tunable``: our
engines' bucket size, prefetch and NVMe sub-group, DDP's bucket size, FSDP1's backward prefetch, DeepSpeed's
bucket size), tried on the setups that can win and on those that missed the GPU or host memory by the least.

Every option value times every setup of the first pass would multiply its traces by the options' values, so the
search is local: the top setups and each implementation's best, each with one option at a time moved off its
default (a coordinate step from the default, as DeepSpeed's autotuner tunes one knob after the stage and
micro-batch). Each variant is traced from the real code like any setup (its memory, its collectives: a smaller
bucket is more, smaller reduce-scatters), or estimated from such a trace (DeepSpeed's), and pruned and ranked with
the rest. An option the user fixed with ``--option`` is not searched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from zbench.cases import registry
from zbench.cases.case import Case
from zbench.tune.search import Candidate, best_per_implementation, setup_key

#: How many of the first pass's fastest setups get their options searched, besides each implementation's best.
SEEDS = 3
#: How many traced setups that missed the GPU by the least, and as many that missed a node's host memory, get their
#: options searched too: a leaner option (a ZeRO-3 prefetch of 0, FSDP1's backward prefetch ``post``; on the
#: host, smaller NVMe sub-groups) may make one fit.
NEAR_MISSES = 3


def variants(case: Case, fixed: Mapping[str, object], seed: str | None = None) -> list[Case]:
    """``case`` with each declared option that applies at its stage and offload set, one at a time, to each of its
    other values; none for an option in ``fixed`` (the user's ``--option``); where ``seed`` says what kind of seed
    ``case`` is (``seed_kind``), only the options searched on it (``Tunable.searched_on``)."""
    out = []
    for tunable in registry.resolve(case.implementation).capabilities.tunables:
        if not tunable.applies(case.stage, case.offload) or tunable.option in fixed:
            continue
        if seed is not None and seed not in tunable.searched_on:
            continue
        for value in tunable.values[1:]:
            out.append(case.model_copy(update={"options": {**case.options, tunable.option: value}}))
    return out


def seeds(ranked: list[Candidate], count: int = SEEDS, near: int = NEAR_MISSES) -> list[Candidate]:
    """The setups whose options are searched: the ``count`` fastest traced, each implementation's best (DeepSpeed's
    estimated one too: its options are searched through its stand-in's, ``zbench.tune.deepspeed_estimate``), the
    ``near`` traced setups that missed the GPU by the least and the ``near`` that missed a node's host memory by
    the least. An estimate ties its stand-in, so among the fastest and the near misses it would only take a traced
    setup's place; a setup pruned by the formulas alone, untraced, has nothing an option could trim."""
    traced = [c for c in ranked if c.estimated_from is None]
    chosen = [c for c in traced if c.pruned is None][:count] + best_per_implementation(ranked)
    for limit in ("GPU", "host per node"):
        missed = (c for c in traced if c.needs is not None and c.pruned is not None and c.pruned.startswith(limit))
        chosen += sorted(missed, key=lambda c: c.overshoot)[:near]
    return list({id(c): c for c in chosen}.values())


def seed_kind(c: Candidate) -> str:
    """``fitting``, or the limit a near miss missed (``GPU``, ``host per node``: its pruning line's first words)."""
    return "fitting" if c.pruned is None else c.pruned.partition(":")[0]


def declared(implementations: tuple[str, ...], fixed: Mapping[str, object]) -> list[str]:
    """One line per implementation whose options are searched: what, over which values, and what each trades."""
    lines = []
    for name in implementations:
        caps = registry.resolve(name).capabilities
        for t in caps.tunables:
            if t.option not in fixed and any(t.applies(stage) for stage in caps.stages):
                values = ", ".join(str(v) for v in t.values)
                where = f" with offload {', '.join(sorted(t.offloads))}" if t.offloads is not None else ""
                if "fitting" not in t.searched_on:
                    where += f", tried only on setups that missed {' or '.join(sorted(t.searched_on))}"
                lines.append(
                    f"{name}: option {t.option} searched over {values} (default {t.values[0]}){where}: {t.trades}"
                )
    return lines


#: How much faster or leaner than the setup it varies a variant must be to be kept (below: a tie, the default wins).
MARGIN = 1e-3


@dataclass
class OptionSearch:
    """What the option search found: the variants kept, and a line saying what it tried and dropped."""

    kept: list[Candidate]
    summary: str


def search_options(
    ranked: list[Candidate], fixed: Mapping[str, object], run: Callable[[list[Case]], list[Candidate]]
) -> OptionSearch:
    """The variants of ``seeds(ranked)``, each searched by ``run`` (``zbench.tune.search.search`` with the
    question's cluster, limits and cache). A variant is kept where it is predicted faster than the setup it
    varies, or fits in less GPU memory, or fits where that setup did not; one that fits nowhere, or changes
    neither (a bucket larger than every gradient of a small model), is dropped and counted, so that the ranking
    is not filled with ties; so is one level with a variant of the same setup kept before it (``_level``)."""
    seen = {setup_key(c.case) for c in ranked}
    pairs: list[tuple[Candidate, Case]] = []
    for seed in seeds(ranked):
        for case in variants(seed.case, fixed, seed_kind(seed)):
            if setup_key(case) not in seen:
                seen.add(setup_key(case))
                pairs.append((seed, case))
    if not pairs:
        return OptionSearch([], "options: nothing to vary")
    found = {setup_key(c.case): c for c in run([case for _, case in pairs])}
    better = [(seed, found[setup_key(case)]) for seed, case in pairs if _better(found[setup_key(case)], seed)]
    kept_pairs: list[tuple[Candidate, Candidate]] = []
    for seed, variant in better:  # in each option's declared order, so the value nearer the default stays
        if not any(s is seed and _level(v, variant) for s, v in kept_pairs):
            kept_pairs.append((seed, variant))
    kept = [variant for _, variant in kept_pairs]
    setups = len({id(seed) for seed, _ in pairs})
    rescued = sum(seed.pruned is not None for seed, _ in kept_pairs)
    level = len(better) - len(kept)
    also = f", or level with a value kept before it: {level}" if level else ""
    summary = (
        f"options: {len(pairs)} variants of {setups} setups traced; {len(kept)} kept (faster or leaner than the setup "
        f"they vary{f', {rescued} fitting where it did not' if rescued else ''}), {len(pairs) - len(kept)} dropped "
        f"(no faster and no leaner, or not fitting{also})"
    )
    return OptionSearch(kept, summary)


def _better(variant: Candidate, seed: Candidate) -> bool:
    if variant.pruned is not None or variant.estimate is None or variant.needs is None:
        return False
    if seed.pruned is not None:  # a near miss (``seeds``): any variant that fits is better
        return True
    assert seed.estimate is not None and seed.needs is not None  # a survivor was predicted
    faster = variant.estimate.tokens_per_s_per_gpu > seed.estimate.tokens_per_s_per_gpu * (1 + MARGIN)
    return faster or variant.needs.gpu < seed.needs.gpu * (1 - MARGIN)


def _level(a: Candidate, b: Candidate) -> bool:
    """Two variants of one setup the model cannot tell apart: the same predicted speed and GPU need within
    ``MARGIN`` (a 16 and a 64 MiB bucket both larger than every gradient of a small model trace alike). The ranking
    keeps one of them, so a top K is K setups a user can choose between, not one setup listed twice."""
    assert a.estimate is not None and b.estimate is not None and a.needs is not None and b.needs is not None
    speed = math.isclose(a.estimate.tokens_per_s_per_gpu, b.estimate.tokens_per_s_per_gpu, rel_tol=MARGIN)
    return speed and math.isclose(a.needs.gpu, b.needs.gpu, rel_tol=MARGIN)
