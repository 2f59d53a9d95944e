"""``zbench tune``: which setup to run for a model on a cluster, from the implementations' real code.

Every implementation x stage x offload mode x micro-batch x activation checkpointing is traced on fake tensors at
the user's GPU count (each trace kept in a cache, so a second question costs seconds), pruned by its traced
memory against the GPU, host and disk, and ranked by the simulator's predicted tokens/s per GPU, with the measured
error of that prediction printed beside it. Progress goes to stderr; stdout is the answer (a table, or one JSON
document with ``--json``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.table import Table
from rich.text import Text

from zbench.cli.options import DEFAULT_PRECISION, JsonOpt, ReportOpt, ResultsOpt, key_values, results_dir, stdout
from zbench.cli.plan import ModelOpt, checked_model_info
from zbench.cli.trace import checked_implementations, checked_offloads, trace_device
from zbench.errors import UsageError
from zbench.plan.memory import DEFAULT_RESERVE
from zbench.values import OFFLOAD_MODES, Precision

ClusterOpt = Annotated[
    str | None,
    typer.Option(
        "--cluster",
        metavar="PROFILE",
        help="The cluster: a built-in profile (h100-sxm, a100-sxm, rtx4090-pcie, cpu-2core) or a YAML file, e.g. "
        "one `zbench calibrate` wrote. Its GPU memory, GPUs per node and links apply unless overridden.",
    ),
]
TuneGpusOpt = Annotated[int, typer.Option(help="GPUs in all (data-parallel ranks).")]
NodesOpt = Annotated[
    int | None, typer.Option(help="Nodes the GPUs are spread over (default: as many as the profile's node size needs).")
]
TuneGpuMemoryOpt = Annotated[float | None, typer.Option("--gpu-memory", help="GiB per GPU (default: the profile's).")]
HostMemoryOpt = Annotated[
    float | None, typer.Option("--host-memory", help="GiB of host memory per node (default: not checked).")
]
DiskOpt = Annotated[float | None, typer.Option("--disk", help="GiB of NVMe per node (default: not checked).")]
GlobalBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--global-batch",
        metavar="TOKENS",
        help="Tokens per optimizer step over all GPUs; each micro-batch gets the gradient accumulation that makes it.",
    ),
]
TuneMicroBatchOpt = Annotated[
    list[int] | None,
    typer.Option("--micro-batch", help="Sequences per rank per forward to try (repeatable; default 1 2 4 8)."),
]
CheckpointingChoice = Annotated[
    Literal["both", "on", "off"],
    typer.Option(help="Activation checkpointing: try both, or only with (on) or without (off)."),
]
TuneSeqLenOpt = Annotated[int | None, typer.Option(help="Tokens per sequence (default: the model's).")]
TuneImplementationOpt = Annotated[
    list[str] | None,
    typer.Option("--implementation", "-i", metavar="IMPL", help="Implementation to search (repeatable; default: all)."),
]
TuneOffloadOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--offload", "-o", metavar="MODE", help="Offload mode to search (repeatable; default: all each supports)."
    ),
]
TuneReserveOpt = Annotated[
    float,
    typer.Option(
        help="Share of each GPU kept free beyond the traced peak: the allocator's fragmentation and the CUDA "
        "context, which no trace sees."
    ),
]
TuneOptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        metavar="KEY=VALUE",
        help="An implementation option, as a suite's `options:` (repeatable; VALUE read as YAML), given to every "
        "searched implementation that takes it; e.g. nvme_chunk_mb=16 for smaller NVMe sub-groups of the "
        "reference engine (default 64 MiB). An option given here is not searched.",
    ),
]
SearchOptionsOpt = Annotated[
    bool,
    typer.Option(
        "--search-options/--no-search-options",
        help="Search the options each implementation declares (bucket size, prefetch) on the fastest setups and "
        "each implementation's best, one option at a time from its default.",
    ),
]
TopOpt = Annotated[int, typer.Option(help="Setups shown in the ranking.")]
FreshOpt = Annotated[
    bool, typer.Option("--fresh", help="Trace every setup again, ignoring (and refreshing) the trace cache.")
]
WholeOpt = Annotated[
    bool,
    typer.Option(
        "--whole",
        help="Trace each setup's whole model, not two cuts of it (5 and 6 blocks) extrapolated over blocks: exact, "
        "and minutes per setup at 70B.",
    ),
]
EmitSuiteOpt = Annotated[
    Path | None,
    typer.Option(
        "--emit-suite",
        metavar="FILE",
        help="Write the top K setups as a suite `zbench run` takes (one implementation entry per setup, each "
        "checked against a DDP case trained the same way), with the predictions in its header.",
    ),
]
EmitDeepSpeedOpt = Annotated[
    Path | None,
    typer.Option(
        "--emit-deepspeed",
        metavar="FILE",
        help="Write DeepSpeed's best setup (estimated: see the ranking) as a DeepSpeed JSON config, for a suite's "
        "`deepspeed_config:` or your own training script.",
    ),
]
VerifyOpt = Annotated[
    int,
    typer.Option(
        "--verify",
        metavar="N",
        help="Run the top N setups for real on this machine (the profile must be one `zbench calibrate` wrote "
        "here): short runs checked against DDP, stored and reported as a run, with predicted against measured "
        "order and memory.",
    ),
]
NvmeDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--nvme-dir",
        metavar="DIR",
        help="Where an NVMe-offload setup swaps, in the emitted suite and under --verify (a directory on a local "
        "disk; a suite with such a setup and none is refused when run).",
    ),
]
VerifyStepsOpt = Annotated[int, typer.Option(help="Steps each verified setup trains (the first 3 are warm-up).")]
PairedRoundsOpt = Annotated[
    int, typer.Option(help="Rounds of one step of each verified setup and one of DDP, alternating (the paired ratio).")
]
TuneDeviceOpt = Annotated[
    Literal["auto", "cpu", "cuda"],
    typer.Option(help="The fake tensors' device (as `zbench plan --device`): auto is cuda where a GPU is visible."),
]


def tune(
    model: ModelOpt = None,
    cluster: ClusterOpt = None,
    gpus: TuneGpusOpt = 8,
    nodes: NodesOpt = None,
    gpu_memory: TuneGpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    disk: DiskOpt = None,
    global_batch: GlobalBatchOpt = None,
    micro_batch: TuneMicroBatchOpt = None,
    seq_len: TuneSeqLenOpt = None,
    precision: Annotated[Precision, typer.Option(help="Training precision (bf16/fp16: mixed).")] = DEFAULT_PRECISION,
    implementation: TuneImplementationOpt = None,
    offload: TuneOffloadOpt = None,
    checkpointing: CheckpointingChoice = "both",
    option: TuneOptionOpt = None,
    search_options: SearchOptionsOpt = True,
    reserve: TuneReserveOpt = DEFAULT_RESERVE,
    top: TopOpt = 10,
    fresh: FreshOpt = False,
    whole: WholeOpt = False,
    device: TuneDeviceOpt = "auto",
    emit_suite: EmitSuiteOpt = None,
    emit_deepspeed: EmitDeepSpeedOpt = None,
    verify: VerifyOpt = 0,
    nvme_dir: NvmeDirOpt = None,
    verify_steps: VerifyStepsOpt = 12,
    paired_rounds: PairedRoundsOpt = 10,
    results: ResultsOpt = None,
    report: ReportOpt = Path("reports"),
    as_json: JsonOpt = False,
) -> None:
    """The setup to run for a model on a cluster: every implementation, stage, offload mode, micro-batch and
    checkpointing choice, traced from the real code, pruned by memory, ranked by predicted tokens/s per GPU.

    Example: zbench tune --model gpt-1.3b --gpus 8 --cluster h100-sxm --host-memory 1024
    """
    started = time.perf_counter()
    _check_numbers(gpus, nodes, gpu_memory, host_memory, disk, global_batch, micro_batch, top, reserve)
    question, profile = _question(
        model, cluster, gpus=gpus, nodes=nodes, global_batch=global_batch, micro_batch=micro_batch, seq_len=seq_len,
        precision=precision, implementation=implementation, offload=offload, checkpointing=checkpointing,
        option=option, device=device,
    )  # fmt: skip
    nvme_dir = nvme_dir.resolve() if nvme_dir else None  # the suite is run from anywhere
    _check_verify(verify, verify_steps, paired_rounds, profile, gpus, nvme_dir)  # before minutes of tracing, not after
    limits = _limits(profile, gpu_memory, host_memory, disk, reserve)
    ranked, notes = _searched(question, profile, limits, fresh=fresh, whole=whole, options=search_options)
    elapsed = time.perf_counter() - started
    document = _document(question, profile, limits, ranked, notes, elapsed)
    if not as_json:
        _print_answer(question, profile, limits, ranked, notes, top, elapsed)
    elif not verify:
        print(json.dumps(document, indent=1))
    _emit(emit_suite, emit_deepspeed, question, profile, ranked, top, nvme_dir)
    if verify:
        _verify(question, ranked, verify, profile, document, (verify_steps, paired_rounds, nvme_dir), results, report,
                as_json)  # fmt: skip


def _limits(
    profile: Any, gpu_memory: float | None, host_memory: float | None, disk: float | None, reserve: float
) -> Any:
    """What one GPU and one node offer: the flags', else the profile's."""
    from zbench.tune.search import GIB, Limits

    return Limits(
        gpu_bytes=(gpu_memory or profile.memory_gib) * GIB, reserve=reserve,
        host_bytes_per_node=host_memory * GIB if host_memory else None,
        disk_bytes_per_node=disk * GIB if disk else None, gpus_per_node=profile.gpus_per_node,
    )  # fmt: skip


def _searched(q: Any, profile: Any, limits: Any, *, fresh: bool, whole: bool, options: bool) -> tuple[list, Any]:
    """Every setup of ``q`` traced (DeepSpeed's estimated), its options searched where ``options``, pruned and
    ranked, survivors first; and the notes: what was left out and which options were searched. None fits: one
    line."""
    from zbench.plan.trace import plan as trace_mod
    from zbench.suite.preflight import DEEPSPEED
    from zbench.tune import deepspeed_estimate, search, space
    from zbench.tune import options as tunables
    from zbench.tune.cache import TraceCache
    from zbench.tune.tracers import Tracers

    found = space.search_space(q)
    found.left_out.extend(deepspeed_estimate.left_out(q))
    if not found.cases:
        raise UsageError("nothing to search: " + "; ".join(found.left_out or ["no setup runs here"]))
    cache = TraceCache()
    progress = trace_mod.stderr_progress
    judged: dict[tuple, Any] = {}  # every traced setup judged so far, by setup_key: each is traced and judged once
    with Tracers() as tracers:

        def traced(cases: list) -> list:
            new = list({search.setup_key(c): c for c in cases if search.setup_key(c) not in judged}.values())
            if new:
                for c in search.search(
                    new, profile, limits, cache=cache, tracers=tracers, fresh=fresh, progress=progress,
                    extrapolate=not whole,
                ):  # fmt: skip
                    judged[search.setup_key(c.case)] = c
            return [judged[search.setup_key(c)] for c in cases]

        def run(cases: list) -> list:
            """``cases`` traced, DeepSpeed's estimated from stand-ins traced in the same rounds."""
            ds = [c for c in cases if c.implementation == DEEPSPEED]
            stand_ins = [deepspeed_estimate.stand_in(q, c) for c in ds]
            rest = traced([c for c in cases if c.implementation != DEEPSPEED] + stand_ins)[: len(cases) - len(ds)]
            return search.ranked(rest + deepspeed_estimate.estimate(ds, stand_ins, traced, profile, limits))

        ranked = run(found.cases + deepspeed_estimate.first_cases(q, found.cases))
        searched = tunables.declared(q.implementations, q.options) if options else []
        if searched:
            progress("options: the fastest setups and each implementation's best, one option at a time")
            found_options = tunables.search_options(ranked, q.options, run)
            ranked = search.ranked(ranked + found_options.kept)
            searched.append(found_options.summary)
    if ranked[0].pruned is not None:  # the survivors come first
        raise UsageError(_nothing_fits(ranked, limits))
    return ranked, Notes(found.left_out, searched)


def _question(
    model: str | None, cluster: str | None, *, gpus: int, nodes: int | None, global_batch: int | None,
    micro_batch: list[int] | None, seq_len: int | None, precision: Precision, implementation: list[str] | None,
    offload: list[str] | None, checkpointing: str, option: list[str] | None, device: str,
) -> tuple[Any, Any]:  # fmt: skip
    """The search the flags ask for, and the cluster profile with the node size they give; one line when bad."""
    from zbench.plan.trace import plan as trace_mod
    from zbench.tune import space

    if model is None:
        raise UsageError("--model is required (a preset, a published architecture, config.json or module:builder)")
    if cluster is None:
        raise UsageError("--cluster is required (a built-in profile such as h100-sxm, or a YAML file)")
    info = checked_model_info(model, built=True)
    profile = _cluster(cluster)
    per_node = gpus // nodes if nodes else min(gpus, profile.gpus_per_node)
    if per_node > profile.gpus_per_node:
        raise UsageError(
            f"--nodes {nodes}: {per_node} GPUs per node, and a {profile.name} node holds {profile.gpus_per_node}"
        )
    seq = info.default_seq_len if seq_len is None else seq_len
    if not 1 <= seq <= info.seq:
        raise UsageError(f"--seq-len must be in 1..{info.seq}")
    checked_offloads(offload)
    dev = trace_device(device)
    question = space.Question(
        model=model, gpus=gpus, precision=precision, seq_len=seq,
        implementations=tuple(checked_implementations(implementation)), offloads=tuple(offload or OFFLOAD_MODES),
        micro_batches=tuple(micro_batch or space.DEFAULT_MICRO_BATCHES),
        checkpointing=_checkpointing(checkpointing, has_blocks=info.has_blocks),
        global_batch_tokens=global_batch, device=dev, options=key_values("--option", option or []),
    )  # fmt: skip
    if untaken := trace_mod.untaken_option(question.implementations, question.options):
        raise UsageError(untaken)
    return question, profile.model_copy(update={"gpus_per_node": per_node})


def _cluster(name: str) -> Any:
    from zbench.plan.simulate.cluster import ClusterError, load

    try:
        return load(name)
    except ClusterError as exc:
        raise UsageError(f"--cluster: {exc}") from None


def _check_numbers(
    gpus: int, nodes: int | None, gpu_memory: float | None, host_memory: float | None, disk: float | None,
    global_batch: int | None, micro_batch: list[int] | None, top: int, reserve: float,
) -> None:  # fmt: skip
    if gpus < 1 or (nodes is not None and nodes < 1) or top < 1:
        raise UsageError("--gpus, --nodes and --top must be positive")
    if nodes is not None and gpus % nodes:
        raise UsageError(f"--nodes {nodes} does not divide --gpus {gpus}: every node holds as many GPUs")
    if any(v is not None and v <= 0 for v in (gpu_memory, host_memory, disk, global_batch)):
        raise UsageError("--gpu-memory, --host-memory, --disk and --global-batch must be positive")
    if any(mb < 1 for mb in micro_batch or ()):
        raise UsageError("--micro-batch must be >= 1")
    if not 0 <= reserve < 1:
        raise UsageError(f"--reserve: {reserve} is not in [0, 1)")


def _checkpointing(choice: str, *, has_blocks: bool) -> tuple[bool, ...]:
    if not has_blocks:
        if choice == "on":
            raise UsageError("--checkpointing on: the model has no `blocks` to checkpoint")
        return (False,)
    return {"both": (False, True), "on": (True,), "off": (False,)}[choice]


def _nothing_fits(ranked: list, limits: Any) -> str:
    """One line: no setup fits; the nearest, by how much, and the GPU count at which it would."""
    from zbench.tune.search import gpus_that_would_fit

    traced = [c for c in ranked if c.estimated_from is None]  # an estimate borrows a traced setup's fate
    if all(c.pruned and c.pruned.startswith("cannot trace") for c in traced):
        return f"no setup could be traced; {traced[0].name}: {traced[0].pruned}"
    nearest = next((c for c in traced if c.needs is not None), traced[0])
    line = f"no setup fits; the nearest is {nearest.name}: {nearest.pruned}"
    gpus = gpus_that_would_fit(nearest, limits)
    if gpus:
        how = "its traced activations plus" if nearest.traced else "the lower bound of"
        line += f"; it would fit on about {gpus} GPUs ({how} the formulas' model states)"
    return line


def _gib(nbytes: float) -> str:
    from zbench.results.formatting import fmt_bytes

    return fmt_bytes(nbytes)


@dataclass(frozen=True)
class Notes:
    """What the answer says besides its rows: what the search left out, and the options it searched."""

    left_out: list[str]
    options_searched: list[str]


def _print_answer(q: Any, profile: Any, limits: Any, ranked: list, notes: Notes, top: int, elapsed: float) -> None:
    from zbench.plan.simulate.sweep import MEASURED_ERROR
    from zbench.tune.extrapolate import DEPTHS
    from zbench.tune.search import best_per_implementation, what_separates

    survivors = [c for c in ranked if c.pruned is None]
    pruned = [c for c in ranked if c.pruned is not None]
    nodes = -(-q.gpus // limits.gpus_per_node)
    where = f"{q.gpus} x {profile.gpu} ({nodes} node{'s' if nodes > 1 else ''} of up to {limits.gpus_per_node})"
    batch = f", global batch {q.global_batch_tokens:,} tokens" if q.global_batch_tokens else ""
    table = Table(title=f"{q.model} on {where}, {q.precision}, {q.seq_len} tokens per sequence{batch}")
    columns = ("#", "setup", "tokens/s per GPU", "step", "MFU", "exposed comm", "offload", "GPU peak", "headroom",
               "host per node", "behind the one above")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("setup", "behind the one above") else "right")
    for i, c in enumerate(survivors[:top]):
        e = c.estimate
        above = what_separates(survivors[i - 1], c) if i else ""
        table.add_row(
            str(i + 1), c.name, f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.step_s * 1e3:,.0f} ms", f"{e.mfu:.0%}",
            f"{e.exposed_comm_s * 1e3:,.0f} ms", f"{e.offload_s * 1e3:,.0f} ms", _gib(c.needs.gpu),
            f"{1 - c.needs.gpu / limits.usable_gpu_bytes:.0%}", _gib(c.needs.host_per_node), above,
        )  # fmt: skip
    best = Table(title="each implementation's best")
    for col in ("implementation", "setup", "tokens/s per GPU", "vs the best"):
        best.add_column(col, justify="right" if col in ("tokens/s per GPU", "vs the best") else "left")
    lead = _rate(survivors[0])
    for c in best_per_implementation(ranked):
        rate = _rate(c)
        best.add_row(c.case.implementation, c.name, f"{rate:,.0f}", f"{rate / lead:.2f}x")
    out = stdout()
    out.print(table)
    out.print(best)
    lines = [f"{len(survivors)} of {len(ranked)} setups fit; {len(pruned)} pruned"]
    lines += [f"  pruned {c.name}: {c.pruned}" for c in pruned[:5]]
    if len(pruned) > 5:
        lines.append(f"  ... and {len(pruned) - 5} more (--json lists every one)")
    lines += notes.left_out + notes.options_searched
    if cut := sum(c.extrapolated for c in ranked):
        lines.append(
            f"{cut} setups traced as {q.model} cut to {' and '.join(map(str, DEPTHS))} blocks and extrapolated over "
            "blocks (--whole: whole models)"
        )
    if limits.host_bytes_per_node is None:
        lines.append("host memory not checked (give --host-memory GiB per node)")
    lines.append(MEASURED_ERROR[profile.compute_model()])
    traced = [c for c in ranked if c.traced is not None and c.estimated_from is None]
    cached = sum(c.cached for c in traced)
    estimated = sum(c.estimated_from is not None for c in ranked)
    untraced = len(ranked) - len(traced) - estimated
    lines.append(
        f"answered in {elapsed:.0f} s: {len(traced)} setups traced ({cached} from the cache), "
        f"{untraced} pruned untraced" + (f", {estimated} estimated from those traces" if estimated else "")
    )
    for line in lines:
        out.print(Text(line))


def _rate(c: Any) -> float:
    return float(c.estimate.tokens_per_s_per_gpu)


def _document(q: Any, profile: Any, limits: Any, ranked: list, notes: Notes, elapsed: float) -> dict[str, Any]:
    from dataclasses import asdict

    from zbench.plan.simulate.sweep import MEASURED_ERROR

    def setup(c: Any) -> dict[str, Any]:
        case = c.case
        return {
            "name": c.name, "implementation": case.implementation, "stage": case.stage, "offload": case.offload,
            "micro_batch": case.micro_batch, "grad_accum": case.grad_accum,
            "checkpointing": case.activation_checkpointing, "options": case.options, "cached": c.cached,
            "extrapolated": c.extrapolated,
            "estimated_from": c.estimated_from,
            "needs": asdict(c.needs) if c.needs else None, "pruned": c.pruned,
            "estimate": c.estimate.to_json() if c.estimate else None,
        }  # fmt: skip

    return {
        "question": asdict(q),
        "cluster": profile.name,
        "gpus_per_node": limits.gpus_per_node,
        "limits": asdict(limits),
        "measured_error": MEASURED_ERROR[profile.compute_model()],
        "ranked": [setup(c) for c in ranked if c.pruned is None],
        "pruned": [setup(c) for c in ranked if c.pruned is not None],
        "left_out": notes.left_out,
        "options_searched": notes.options_searched,
        "seconds": round(elapsed, 1),
    }


def _check_verify(verify: int, steps: int, paired_rounds: int, profile: Any, gpus: int, nvme: Path | None) -> None:
    if verify < 0 or steps < 2 or paired_rounds < 0:
        raise UsageError("--verify and --paired-rounds must be >= 0, --verify-steps >= 2")
    if verify:
        from zbench.tune.verify import check_verifiable

        check_verifiable(profile, gpus, nvme)


def _emit(
    suite: Path | None, deepspeed: Path | None, q: Any, profile: Any, ranked: list, top: int, nvme_dir: Path | None
) -> None:
    """``--emit-suite`` and ``--emit-deepspeed``, each when asked."""
    if suite is not None:
        _emit_suite(suite, q, profile, [c for c in ranked if c.pruned is None][:top], nvme_dir)
    if deepspeed is not None:
        _emit_deepspeed(deepspeed, ranked, on_gpu=not profile.on_cpu())


def _emit_suite(path: Path, q: Any, profile: Any, chosen: list, nvme_dir: Path | None) -> None:
    """The chosen setups as a suite file, each one's predicted rank and figures in the header."""
    from zbench.plan.simulate.sweep import MEASURED_ERROR
    from zbench.tune import emit

    header = [
        f"Written by `zbench tune` {time.strftime('%Y-%m-%d')}: the top {len(chosen)} setups for {q.model} on "
        f"{q.gpus} x {profile.gpu} ({profile.name}), best first,",
        "predicted by the step-time simulator; " + MEASURED_ERROR[profile.compute_model()],
        "",
    ]
    for i, c in enumerate(chosen, 1):
        how = "estimated" if c.estimated_from else "traced"
        header.append(f"{i}. {c.name}: {c.estimate.tokens_per_s_per_gpu:,.0f} tokens/s per GPU predicted, GPU peak "
                      f"{_gib(c.needs.gpu)} {how}")  # fmt: skip
    device = "cpu" if profile.on_cpu() else "cuda"
    settings: dict[str, Any] = {"nvme_dir": str(nvme_dir)} if nvme_dir else {}
    if nvme_dir is None and any(c.case.offload == "nvme" for c in chosen):
        header += ["", "An NVMe-offload setup: set nvme_dir (a directory on a local disk) before running."]
    text = emit.suite_text(emit.suite_document(q, [c.case for c in chosen], device=device, **settings), header)
    emit.write(path, text)
    print(f"suite of {len(chosen)} setups written to {path}", file=sys.stderr)


def _emit_deepspeed(path: Path, ranked: list, *, on_gpu: bool) -> None:
    from zbench.suite.preflight import DEEPSPEED
    from zbench.tune import emit

    best = next((c for c in ranked if c.pruned is None and c.case.implementation == DEEPSPEED), None)
    if best is None:
        raise UsageError("--emit-deepspeed: no DeepSpeed setup fits (or -i left DeepSpeed out of the search)")
    emit.write(path, emit.deepspeed_text(best.case, on_gpu=on_gpu))
    print(f"DeepSpeed config of {best.name} written to {path}", file=sys.stderr)


def _verify(
    q: Any, ranked: list, n: int, profile: Any, document: dict[str, Any], how: tuple[int, int, Path | None],
    results: Path | None, report: Path, as_json: bool,
) -> None:  # fmt: skip
    """Run the chosen setups, show predicted against measured, write the report; exit 1 on a failed setup."""
    from zbench.report import render
    from zbench.tune.verify import verify

    root = results_dir(None, results)
    chosen = [c for c in ranked if c.pruned is None][:n]
    steps, paired_rounds, nvme_dir = how
    print(f"verifying the top {len(chosen)} setups: {steps} steps each, checked against DDP", file=sys.stderr)
    checked, result = verify(
        q, chosen, profile, results_root=root, steps=steps, paired_rounds=paired_rounds, search_document=document,
        nvme_dir=str(nvme_dir) if nvme_dir else None,
    )  # fmt: skip
    page = render(result.run, report, results_root=root)
    if as_json:
        print(json.dumps({**document, "verification": checked.to_json()}, indent=1))
    else:
        _print_verification(checked)
    print(f"results: {result.run.path}\nreport:  {page}", file=sys.stderr)
    if result.failed or any(r.tune_error for r in checked.rows):
        raise typer.Exit(1)


def _print_verification(v: Any) -> None:
    from zbench.results.formatting import fmt_ratio

    table = Table(title=f"predicted against measured (run {v.run_id})")
    for col in ("predicted #", "setup", "predicted tokens/s per GPU", "measured", "measured #", "GPU peak traced",
                "measured peak", "ratio to DDP", "status", "equivalent"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("setup", "status") else "right")
    ran = sorted((r for r in v.rows if r.measured_tokens_per_s_per_gpu), key=lambda r: -r.measured_tokens_per_s_per_gpu)
    measured_rank = {r.rank: i for i, r in enumerate(ran, 1)}
    for r in v.rows:
        status = r.status + (f": TUNE ERROR, {r.tune_error}" if r.tune_error else "")
        table.add_row(
            str(r.rank), r.name, f"{r.predicted_tokens_per_s_per_gpu:,.0f}",
            f"{r.measured_tokens_per_s_per_gpu:,.0f}" if r.measured_tokens_per_s_per_gpu else "-",
            str(measured_rank.get(r.rank, "-")), _gib(r.predicted_gpu_bytes),
            _gib(r.measured_peak_bytes) + (f" ({r.memory_kind})" if r.memory_kind else "")
            if r.measured_peak_bytes else "-",
            fmt_ratio(r.ratio_to_ddp), status, {True: "yes", False: "NO", None: "-"}[r.equivalent],
        )  # fmt: skip
    out = stdout()
    out.print(table)
    tau = "-" if v.kendall_tau is None else f"{v.kendall_tau:.2f}"
    best = "-" if v.measured_best_rank is None else f"predicted #{v.measured_best_rank}"
    if v.level_with_best:
        from zbench.tune.verify import LEVEL_P

        level = ", ".join(f"#{rank}" for rank in v.level_with_best)
        best += f" (measured level with {level}: Mann-Whitney p >= {LEVEL_P} on the paired ratios)"
    out.print(Text(f"Kendall tau, predicted against measured order: {tau}; the measured best was {best}"))
    for note in v.notes:
        out.print(Text(note))
