"""``zbench tune --verify N``: the top N setups run for real on this machine, the prediction held against them.

The chosen setups become a suite (``zbench.tune.emit``) that ``zbench run``'s own runner trains: short runs, each
checked against a DDP case trained the same way, paired rounds of it and DDP for the step-time ratio, results and
report written as for any suite. Then the predicted order is compared with the measured one (Kendall's tau over
tokens/s per GPU, and whether the measured best is among the predicted top two), and each setup's predicted GPU
peak with the one measured. A setup predicted to fit that runs out of memory is a tune error, stated as such.

Verifying a prediction only means something on the machine the prediction was made for: the profile must be
one ``zbench calibrate`` wrote on this host, for this device.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import kendalltau, mannwhitneyu

from zbench.atomic import atomic_write_json
from zbench.cases.case import Case
from zbench.errors import UsageError
from zbench.plan.simulate.cluster import Cluster
from zbench.plan.simulate.sweep import CALIBRATED_RATIO_ERROR
from zbench.report.tune_page import TUNE_FILE
from zbench.results.record import CaseRecord
from zbench.run.console import Progress
from zbench.run.runner import RunResult, run_suite
from zbench.suite import config as suite_config
from zbench.suite import preflight
from zbench.tune import emit
from zbench.tune.search import Candidate
from zbench.tune.space import Question


def this_device() -> str:
    """What ``zbench calibrate`` records as the device here: the first GPU's name, or ``cpu``."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def check_verifiable(profile: Cluster, gpus: int, nvme_dir: Path | None) -> None:
    """One line, unless the chosen setups can run here: a profile calibrated here, as many ranks as this machine
    has for ``gpus``, an NVMe directory that exists."""
    check_this_machine(profile)
    preflight.check_world_sizes(preflight.resolve_device("auto"), [gpus], "--verify")
    if nvme_dir is not None and not nvme_dir.is_dir():
        raise UsageError(f"--nvme-dir {nvme_dir}: not a directory")


def check_this_machine(profile: Cluster) -> None:
    """One line, unless ``profile`` is a calibration of this host and its device."""
    cal = profile.calibration
    if cal is None:
        raise UsageError(
            f"--verify: the profile {profile.name!r} was not measured here; verify against a profile `zbench "
            "calibrate` wrote on this machine (--cluster that file)"
        )
    here, device = platform.node(), this_device()
    if cal.host != here or cal.device != device:
        raise UsageError(
            f"--verify: the profile {profile.name!r} was calibrated on {cal.host} ({cal.device}), not on this "
            f"machine, {here} ({device})"
        )


@dataclass
class Verified:
    """One chosen setup: its predicted rank and figures, and what its run measured."""

    rank: int
    name: str
    case_id: str
    predicted_tokens_per_s_per_gpu: float
    predicted_gpu_bytes: float
    status: str = "not run"
    measured_tokens_per_s_per_gpu: float | None = None
    steady_tokens_per_s_per_gpu: float | None = None
    """Its own steps' rate (their median), read apart from DDP's: beside the paired rate, a check on the machine."""
    measured_peak_bytes: int | None = None
    memory_kind: str | None = None
    ratio_to_ddp: float | None = None
    equivalent: bool | None = None
    error: str | None = None
    tune_error: str | None = None
    """Set when the prediction was wrong in a way that matters: predicted to fit, and ran out of memory."""


@dataclass
class Verification:
    """The chosen setups' run and how the prediction held."""

    run_id: str
    run_path: str
    rows: list[Verified]
    kendall_tau: float | None
    measured_best_rank: int | None
    """The predicted rank of the setup that measured fastest."""
    level_with_best: list[int] = field(default_factory=list)
    """The predicted ranks of the setups the measurement cannot tell from the fastest (``level_with``)."""
    resolved_pairs: int = 0
    """Pairs of setups whose measured rates the paired rounds tell apart (``resolved_order``)."""
    resolved_agreeing: int = 0
    """Of those, the pairs the prediction orders as measured."""
    notes: list[str] = field(default_factory=list)

    @property
    def best_in_top_two(self) -> bool | None:
        return None if self.measured_best_rank is None else self.measured_best_rank <= 2

    @property
    def a_best_in_top_two(self) -> bool | None:
        """The fastest, or a setup measured level with it, was predicted in the top two."""
        return None if self.measured_best_rank is None else min([self.measured_best_rank, *self.level_with_best]) <= 2

    @property
    def resolved_gamma(self) -> float | None:
        """Goodman and Kruskal's gamma over the resolved pairs: 1 when the prediction orders every pair the
        measurement can order as it was measured, -1 when it reverses every one. Kendall's tau counts the pairs
        the measurement cannot tell apart as well, whose measured order is the machine's noise."""
        return gamma(self.resolved_pairs, self.resolved_agreeing)

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "best_in_top_two": self.best_in_top_two, "a_best_in_top_two": self.a_best_in_top_two,
                "resolved_gamma": self.resolved_gamma}  # fmt: skip


def verify(
    q: Question,
    chosen: list[Candidate],
    profile: Cluster,
    *,
    results_root: Path,
    steps: int,
    paired_rounds: int,
    search_document: dict[str, Any],
    nvme_dir: str | None = None,
) -> tuple[Verification, RunResult]:
    """Train ``chosen`` (ranked, best first) as a suite, store it as any run, and compare with the prediction;
    ``search_document`` (what tune searched, pruned and predicted) is kept beside the run for its report page."""
    document = emit.suite_document(
        q, [c.case for c in chosen], device=preflight.resolve_device("auto"), steps=steps,
        warmup_steps=min(3, steps - 1), paired_rounds=paired_rounds, fp32_probe=False,
        **({"nvme_dir": nvme_dir} if nvme_dir else {}),
    )  # fmt: skip
    suite_file = suite_config.from_flags(suite_config.from_dict(document, source="the verification suite"))
    suite = preflight.prepare(suite_file)
    result = run_suite(suite, results_root=results_root, resume=None, progress=Progress())
    verification = compare(chosen, result)
    atomic_write_json(
        Path(result.run.path) / TUNE_FILE,
        {"search": search_document, "suite": document, "verification": verification.to_json()},
    )
    return verification, result


def _same_setup(case: Case, c: Candidate) -> bool:
    want = c.case
    return (
        not case.noise_twin
        and case.precision == want.precision
        and case.options == want.options
        and case.implementation == want.implementation
        and case.stage == want.stage
        and case.offload == want.offload
        and case.micro_batch == want.micro_batch
        and case.grad_accum == want.grad_accum
        and case.activation_checkpointing == want.activation_checkpointing
    )


def compare(chosen: list[Candidate], result: RunResult) -> Verification:
    """Each chosen setup's record read against its prediction; the orders compared over the setups that ran."""
    rows = []
    samples: dict[int, list[float]] = {}
    for rank, c in enumerate(chosen, 1):
        record = next((r for r in result.records if _same_setup(r.config, c)), None)
        assert c.estimate is not None and c.needs is not None  # chosen setups are ranked survivors
        row = Verified(
            rank=rank, name=c.name, case_id=record.case_id if record else "-",
            predicted_tokens_per_s_per_gpu=c.estimate.tokens_per_s_per_gpu, predicted_gpu_bytes=c.needs.gpu,
        )  # fmt: skip
        if record is not None:
            _measured(row, record, result.records)
            samples[rank] = rate_samples(record, result.records)
        rows.append(row)
    ran = [r for r in rows if r.measured_tokens_per_s_per_gpu is not None]
    tau = _kendall_tau(ran)
    best = max(ran, key=lambda r: r.measured_tokens_per_s_per_gpu or 0.0, default=None)
    level = [] if best is None else level_with(best.rank, [r.rank for r in ran if r is not best], samples)
    resolved, agreeing = resolved_order(ran, samples)
    return Verification(
        run_id=result.run.run_id, run_path=str(result.run.path), rows=rows, kendall_tau=tau,
        measured_best_rank=best.rank if best else None, level_with_best=level, resolved_pairs=resolved,
        resolved_agreeing=agreeing, notes=_notes(rows, ran, tau, resolved, agreeing),
    )  # fmt: skip


def _kendall_tau(ran: list[Verified]) -> float | None:
    """Kendall's tau between the predicted and measured rates; None for fewer than two, or where either is all
    alike (NaN would not survive JSON)."""
    if len(ran) < 2:
        return None
    tau = float(
        kendalltau(
            [r.predicted_tokens_per_s_per_gpu for r in ran], [r.measured_tokens_per_s_per_gpu for r in ran]
        ).statistic
    )
    return None if math.isnan(tau) else tau


def _notes(rows: list[Verified], ran: list[Verified], tau: float | None, resolved: int, agreeing: int) -> list[str]:
    """What the reader of the comparison must know to weigh it."""
    notes = []
    if len(ran) >= 2 and tau is None:
        notes.append("the predictions (or the measurements) are all equal: no order to compare")
    predicted = [r.predicted_tokens_per_s_per_gpu for r in ran]
    if len(ran) >= 2 and (spread := max(predicted) / min(predicted) - 1) < CALIBRATED_RATIO_ERROR:
        notes.append(
            f"the predictions lie within {spread:.1%} of each other, inside the step model's median error on a "
            f"ratio to DDP ({CALIBRATED_RATIO_ERROR:.1%} on calibrated CPU profiles): an order this close is a guess, "
            "and tau with it"
        )
    if len(ran) < len(rows):
        notes.append(f"{len(rows) - len(ran)} of {len(rows)} setups have no measured step time; the orders compare "
                     "the rest")  # fmt: skip
    if len(ran) >= 2:
        notes.append(resolved_note(len(ran), resolved, agreeing))
    return notes + [disturbed(r) for r in ran if disagreement(r) > DISAGREEMENT]


#: The significance below which two setups' paired ratios are told apart (two-sided Mann-Whitney U).
LEVEL_P = 0.05


def rate_samples(record: CaseRecord, records: list[CaseRecord]) -> list[float]:
    """A setup's tokens/s per GPU round by round: its DDP reference's rate over each round's paired ratio (the
    rounds ``measured_rate`` takes the median of); the reference's own rate in each round (the yardstick); none for
    a setup without paired rounds."""
    reference = _reference(record, records)
    if reference is None or reference.summary.tokens_per_s_per_rank is None:
        return []
    base = reference.summary.tokens_per_s_per_rank
    if reference is record:
        return [base] * record.config.paired_rounds
    return [base / ratio for ratio in record.paired.ratios] if record.paired is not None else []


def _reference(record: CaseRecord, records: list[CaseRecord]) -> CaseRecord | None:
    reference_id = record.equivalence.reference_case if record.equivalence else None
    return next((r for r in records if r.case_id == reference_id), None)


def told_apart(a: list[float], b: list[float]) -> bool | None:
    """Whether a two-sided Mann-Whitney U test on two setups' rounds says their rates differ (p < ``LEVEL_P``);
    None where either has fewer than two rounds."""
    if len(a) < 2 or len(b) < 2:
        return None
    return bool(mannwhitneyu(a, b, alternative="two-sided").pvalue < LEVEL_P)


def level_with(best: int, others: list[int], samples: dict[int, list[float]]) -> list[int]:
    """Of ``others``, the setups whose rounds (``rate_samples``) cannot be told from ``best``'s (``told_apart``):
    the measurement does not say which of them is faster. A setup with fewer than two rounds is not compared
    (neither level nor told apart)."""
    return [rank for rank in others if told_apart(samples.get(best, []), samples.get(rank, [])) is False]


def resolved_order(ran: list[Verified], samples: dict[int, list[float]]) -> tuple[int, int]:
    """How many pairs of setups the measurement orders (``told_apart``), and how many of those the prediction
    orders the same way. On a machine whose steps vary by several percent from round to round, setups predicted
    within a percent or two of each other are measured in an order that is noise; these pairs are the ones a
    wrong prediction could not hide in."""
    resolved = agreeing = 0
    for i, a in enumerate(ran):
        for b in ran[i + 1 :]:
            if told_apart(samples.get(a.rank, []), samples.get(b.rank, [])):
                resolved += 1
                predicted = a.predicted_tokens_per_s_per_gpu - b.predicted_tokens_per_s_per_gpu
                measured = (a.measured_tokens_per_s_per_gpu or 0.0) - (b.measured_tokens_per_s_per_gpu or 0.0)
                agreeing += predicted * measured > 0
    return resolved, agreeing


def gamma(resolved: int, agreeing: int) -> float | None:
    """Goodman and Kruskal's gamma of ``agreeing`` concordant pairs out of ``resolved``; None without any."""
    return (2 * agreeing - resolved) / resolved if resolved else None


def resolved_note(ran: int, resolved: int, agreeing: int) -> str:
    pairs = ran * (ran - 1) // 2
    told = f"the measurement tells {resolved} of {pairs} pairs of setups apart (Mann-Whitney p < {LEVEL_P} on their "
    if not resolved:
        return told + "paired rounds): the measured order is the machine's noise"
    return (
        told + f"paired rounds); the prediction orders {agreeing} of them as measured (gamma "
        f"{gamma(resolved, agreeing):.2f})"
    )


#: How far a setup's paired rate and its own steps' rate may differ before its measurement is called disturbed:
#: the two read the same speed two ways (steps taken back to back with DDP's; steps of its own, minutes from
#: DDP's), so beyond their usual disagreement (median 5%, 2026-11-30, docs/data/validate_simulator_1130e.json)
#: the machine's speed changed under one of them.
DISAGREEMENT = 0.10


def disagreement(row: Verified) -> float:
    """How far ``row``'s paired rate and its own steps' rate differ (0 where either is missing)."""
    paired, steady = row.measured_tokens_per_s_per_gpu, row.steady_tokens_per_s_per_gpu
    return abs(paired / steady - 1) if paired and steady else 0.0


def disturbed(row: Verified) -> str:
    return (
        f"#{row.rank}'s rate read from its paired rounds ({row.measured_tokens_per_s_per_gpu:,.0f} tokens/s per GPU) "
        f"and from its own steps ({row.steady_tokens_per_s_per_gpu:,.0f}) differ by {disagreement(row):.0%}: the "
        "machine's speed changed during its run, so its measured place is uncertain (run it again)"
    )


def measured_rate(record: CaseRecord, records: list[CaseRecord]) -> float | None:
    """Tokens/s per GPU a setup's run measured: its DDP reference's rate over the paired step-time ratio when it
    has one (the ratio of steps run alternately, which cancels the machine's drift between cases), else its own
    median step's. Setups at one micro-batch share a reference, so their order is the paired ratios' order."""
    own = record.summary.tokens_per_s_per_rank if record.status == "ok" else None
    reference = _reference(record, records)
    paired = record.paired is not None and record.paired.median_ratio is not None
    if own is None or reference is None or reference is record or not paired or record.ratio_to_ddp is None:
        return own
    base = reference.summary.tokens_per_s_per_rank
    return own if base is None else base / record.ratio_to_ddp


def _measured(row: Verified, record: CaseRecord, records: list[CaseRecord]) -> None:
    row.status = record.status
    row.error = record.error
    row.measured_tokens_per_s_per_gpu = measured_rate(record, records)
    row.steady_tokens_per_s_per_gpu = record.summary.tokens_per_s_per_rank if record.status == "ok" else None
    if record.memory is not None:
        row.measured_peak_bytes = record.memory.peak_bytes
        row.memory_kind = record.memory.kind
    row.ratio_to_ddp = record.ratio_to_ddp
    row.equivalent = record.equivalent
    if record.status == "oom":
        row.tune_error = "predicted to fit, ran out of memory"
