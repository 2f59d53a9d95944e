"""``zbench plan``: memory per GPU, host and disk before running, from the ZeRO formulas or (``--trace``,
``--simulate``) from the implementations' own code on fake tensors."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.table import Table

from zbench.cli.options import DEFAULT_PRECISION, JsonOpt, key_values, stdout
from zbench.cli.trace import TraceRequest, plan_trace
from zbench.errors import UsageError
from zbench.plan.memory import DEFAULT_RESERVE
from zbench.values import Precision

if TYPE_CHECKING:
    from zbench.cases.model_source import ModelInfo

ModelOpt = Annotated[
    str | None,
    typer.Option(
        help="Model: a preset or a published architecture (see `zbench list`), path/to/config.json, or "
        "module:builder (your own)."
    ),
]
ParamsOpt = Annotated[float | None, typer.Option(help="Parameter count instead of a model, e.g. 7e9.")]
GpusOpt = Annotated[int, typer.Option(help="Data-parallel GPUs (N in the formulas).")]
GpuMemoryOpt = Annotated[float | None, typer.Option("--gpu-memory", help="GiB per GPU; shows which combinations fit.")]
PerNodeOpt = Annotated[int | None, typer.Option(help="GPUs sharing one host's memory (default: all).")]
PlanPrecisionOpt = Annotated[
    Precision, typer.Option(help="bf16/fp16 (mixed: 2+2+12 bytes per parameter) or fp32 (4+4+8).")
]
ReserveOpt = Annotated[float, typer.Option(help="Share of each GPU kept free for activations and buffers.")]
TraceOpt = Annotated[
    bool,
    typer.Option(
        "--trace",
        help="Run each implementation's real code (build + 3 training steps) on fake tensors in a fake "
        "process group of --gpus ranks and report what rank 0 holds, next to the formulas. Needs --model.",
    ),
]
ImplementationOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--implementation",
        "-i",
        metavar="IMPL",
        help="With --trace: implementation to trace (repeatable; default: every built-in).",
    ),
]
OffloadOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--offload",
        "-o",
        metavar="MODE",
        help="With --trace: offload mode to trace (repeatable; default: every mode each supports).",
    ),
]
MicroBatchOpt = Annotated[int, typer.Option(help="With --trace: sequences per rank per step.")]
SeqLenOpt = Annotated[int | None, typer.Option(help="With --trace: tokens per sequence (default: the model's).")]
CheckpointingOpt = Annotated[
    bool, typer.Option("--checkpointing", help="With --trace: recompute each block's activations in backward.")
]
OptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        metavar="KEY=VALUE",
        help="With --trace: an implementation option, as a suite's `options:` (repeatable; VALUE is read as "
        "YAML), given to each traced implementation that reads it (one line when none does); e.g. "
        "nvme_chunk_mb=16 for smaller NVMe sub-groups of the reference ZeRO engine (default 64 MiB).",
    ),
]
TraceDeviceOpt = Annotated[
    Literal["auto", "cpu", "cuda"],
    typer.Option(
        help="With --trace: the fake tensors' device. auto: cuda where torch is built with CUDA and a GPU is "
        "visible, else cpu (same bytes and traffic; the CPU paths of each implementation)."
    ),
]
SimulateOpt = Annotated[
    str | None,
    typer.Option(
        "--simulate",
        metavar="CLUSTER",
        help="Trace (as --trace does), then predict the step time, tokens/s per GPU, MFU and exposed "
        "communication on CLUSTER (a built-in profile: h100-sxm, a100-sxm, rtx4090-pcie, cpu-2core; or a "
        "YAML file, e.g. one `zbench calibrate` wrote, whose measured tables charge each traced operator) at "
        "every --scale.",
    ),
]
ScaleOpt = Annotated[
    list[int] | None, typer.Option(help="With --simulate: world size to predict (repeatable; default 8 16 ... 1024).")
]


def plan(
    model: ModelOpt = None,
    params: ParamsOpt = None,
    gpus: GpusOpt = 8,
    gpu_memory: GpuMemoryOpt = None,
    gpus_per_node: PerNodeOpt = None,
    precision: PlanPrecisionOpt = DEFAULT_PRECISION,
    reserve: ReserveOpt = DEFAULT_RESERVE,
    trace: TraceOpt = False,
    implementation: ImplementationOpt = None,
    offload: OffloadOpt = None,
    micro_batch: MicroBatchOpt = 1,
    seq_len: SeqLenOpt = None,
    checkpointing: CheckpointingOpt = False,
    option: OptionOpt = None,
    device: TraceDeviceOpt = "auto",
    simulate: SimulateOpt = None,
    scale: ScaleOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Memory per GPU, per host and on disk for every ZeRO stage x offload mode, from the formulas, before running.

    With --trace, from the implementations' own code instead: model states by category and location, the peak
    of live tensor bytes and what it is made of, and the collectives of one step, per rank, at any scale.
    """
    _check_plan_args(model, params, gpus, gpu_memory, reserve, traced=trace or simulate is not None, option=option)
    if trace or simulate:
        if model is None:
            raise UsageError("--trace and --simulate need --model (its shape is what runs)")
        request = TraceRequest(
            model=model, gpus=gpus, precision=precision, implementations=implementation, offloads=offload,
            micro_batch=micro_batch, seq_len=seq_len, checkpointing=checkpointing,
            options=key_values("--option", option or []), device=device, gpu_memory=gpu_memory,
            gpus_per_node=gpus_per_node, as_json=as_json, simulate=simulate, scales=scale,
        )  # fmt: skip
        plan_trace(request)
        return
    _formula_plan(model, params, gpus, precision, gpu_memory, gpus_per_node, reserve, as_json=as_json)


def _check_plan_args(
    model: str | None,
    params: float | None,
    gpus: int,
    gpu_memory: float | None,
    reserve: float,
    *,
    traced: bool,
    option: list[str] | None,
) -> None:
    if (model is None) == (params is None):
        raise UsageError("give exactly one of --model NAME or --params N")
    if model is not None:
        checked_model_info(model, built=traced)
    if gpus < 1 or (params is not None and params < 1) or (gpu_memory is not None and gpu_memory <= 0):
        raise UsageError("--gpus, --params and --gpu-memory must be positive")
    if not 0 <= reserve < 1:
        raise UsageError(f"--reserve: {reserve} is not in [0, 1)")
    if option and not traced:
        raise UsageError("--option applies to traced implementations: add --trace or --simulate")


def checked_model_info(model: str, *, built: bool) -> ModelInfo:
    """``--model``'s figures, or one line: an unknown name, or (``built``: traced) transformers missing."""
    from zbench.cases.model_source import ModelSourceError, check_buildable, model_info

    try:
        info = model_info(model)
        if built:
            check_buildable(info)
    except ModelSourceError as exc:
        raise UsageError(f"--model: {exc}") from None
    return info


def _formula_plan(
    model: str | None,
    params: float | None,
    gpus: int,
    precision: Precision,
    gpu_memory: float | None,
    gpus_per_node: int | None,
    reserve: float,
    *,
    as_json: bool,
) -> None:
    """The formulas' answer for every stage x offload mode, as JSON or a table."""
    from zbench.plan import memory

    info = checked_model_info(model, built=False) if model else None
    n = info.parameters if info else int(params or 0)
    rows = memory.plan(
        params=n,
        gpus=gpus,
        precision=precision,
        cfg=(info.gpt or info.arch) if info else None,
        reserve=reserve,
        gpus_per_node=gpus_per_node,
        gpu_memory_bytes=gpu_memory * 2**30 if gpu_memory else None,
    )
    if as_json:
        figures = memory.as_json(
            rows, model=model, parameters=n, gpus=gpus, precision=precision, gpu_memory_gib=gpu_memory, reserve=reserve
        )
        print(json.dumps(figures, indent=1))
        return
    title = f"{model or 'model'}: {n:,} parameters, {gpus} GPUs, {precision}"
    if gpu_memory:
        title += f", {gpu_memory:g} GiB per GPU ({reserve:.0%} kept for activations)"
    stdout().print(_formula_table(rows, n, title))


def _formula_table(rows: list, parameters: int, title: str) -> Table:
    from zbench.results.formatting import fmt_bytes

    table = Table(title=title)
    for col in (
        "stage / offload",
        "per GPU",
        "  model states",
        "  stage-3 working set",
        "host per rank",
        "host per node",
        "disk per rank",
        "bytes/param on GPU",
        "fits",
    ):
        table.add_column(col, justify="right" if col != "stage / offload" else "left")
    for r in rows:
        table.add_row(
            r.name,
            fmt_bytes(r.device_bytes),
            fmt_bytes(r.model_state_device_bytes),
            fmt_bytes(r.working_set_bytes),
            fmt_bytes(r.host_bytes_per_rank),
            fmt_bytes(r.host_bytes_per_node),
            fmt_bytes(r.disk_bytes_per_rank),
            f"{r.model_state_device_bytes / parameters:.2f}",
            {True: "yes", False: "NO", None: "-"}[r.fits],
        )
    return table
