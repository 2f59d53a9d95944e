"""``zbench calibrate``: measure this machine and write a cluster profile for ``plan --simulate`` and
``report --simulate``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zbench.errors import OneLineError, UsageError

#: A collective's fit off by more than this (median relative error) is worth a note: the machine was busy.
NOISY_FIT = 0.2

if TYPE_CHECKING:
    from rich.table import Table

    from zbench.plan.simulate.cluster import Cluster

OutOpt = Annotated[
    Path | None, typer.Option("--out", "-o", help="Write the profile here (YAML) instead of printing it.")
]
NameOpt = Annotated[str | None, typer.Option(help="The profile's name (default: calibrated-HOSTNAME).")]
RanksOpt = Annotated[
    list[int] | None,
    typer.Option(
        min=1,
        help="Ranks the collectives run over: GPUs (default: every visible one) or, without a GPU, CPU cores "
        "(default: all, at most 4; each rank one thread, as a CPU run of zbench). Repeat it to measure the "
        "collectives over more rank counts too (--ranks 2 --ranks 4: a CPU suite's world 4 on two cores); the "
        "first sets the node, and the simulator takes a measured curve wherever a world size has one.",
    ),
]
NvmeDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--nvme-dir",
        help="Directory on the drive NVMe offload would use, for its write and read speed (default: the system's "
        "temporary directory, named in the profile).",
    ),
]
BaseOpt = Annotated[
    str | None,
    typer.Option(
        help="Profile (built-in name or file) for what one host cannot measure: the link between nodes, and the "
        "links altogether on a single GPU.",
    ),
]
AgainstOpt = Annotated[
    str | None,
    typer.Option(
        help="A profile (an earlier calibration, or a built-in) to compare this calibration with, figure by figure "
        "(a table on stderr): how far the machine moved between the two.",
    ),
]
QuickOpt = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="Fewer repeats (and on a CPU smaller probes): a rough profile in about 10 s on a CPU.",
    ),
]


def calibrate_cmd(
    out: OutOpt = None,
    name: NameOpt = None,
    ranks: RanksOpt = None,
    nvme_dir: NvmeDirOpt = None,
    base: BaseOpt = None,
    against: AgainstOpt = None,
    quick: QuickOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON instead of YAML.")] = False,
) -> None:
    """Measure this machine (matrix products, memory bandwidth, collectives against message size, copies,
    hooks, the disk, the host optimizer) and write a cluster profile. At most a few minutes; progress on
    stderr."""
    from zbench.cli.options import stderr
    from zbench.plan.calibrate.fit import FitError
    from zbench.plan.calibrate.machine import Machine, calibrate
    from zbench.plan.calibrate.profile import derive, to_yaml

    disk = _writable_paths(nvme_dir, out)
    base_profile, earlier = _profiles(base, against)
    machine = Machine.here(ranks[0] if ranks else None)
    also = tuple(dict.fromkeys(r for r in (ranks or [])[1:] if r > 1 and r != machine.ranks))
    if machine.ranks == 1 and base_profile is None:  # refused before minutes of measuring, not after
        raise UsageError("one rank here: no collective can be measured; give --base PROFILE for the links")
    console = stderr()
    console.print(f"calibrating {machine.name} x {machine.ranks} ({machine.backend})")
    try:
        measured = calibrate(machine, disk_dir=disk, quick=quick, progress=console.print, also_ranks=also)
    except FitError as exc:
        busy = "a machine too busy to measure, three times over: run it when it is quieter"
        raise OneLineError(f"calibration failed: {exc} ({busy})") from None
    for curve in measured.collectives:
        if curve.fit_error > NOISY_FIT:
            console.print(f"note: {curve.op}'s latency-bandwidth fit is off by {curve.fit_error:.0%} (median): noisy")
    per_node = base_profile.gpus_per_node if base_profile and not measured.collectives else machine.per_node
    profile = derive(
        measured, name=name or f"calibrated-{measured.host}", gpu=machine.name, memory_gib=machine.memory_gib,
        ranks_per_node=per_node, base=base_profile,
    )  # fmt: skip
    if earlier is not None:
        console.print(_comparison(earlier, profile))
    text = json.dumps(profile.model_dump(mode="json", exclude_none=True), indent=1) if as_json else to_yaml(profile)
    if out is None:
        print(text)
        return
    from zbench.atomic import atomic_write_bytes

    atomic_write_bytes(out, (text + "\n").encode())
    console.print(f"wrote {out} ({measured.seconds:.0f} s): use it as `zbench plan --simulate {out}`", soft_wrap=True)


def _writable_paths(nvme_dir: Path | None, out: Path | None) -> Path:
    """The disk probe's directory, after checking it and ``--out``'s folder can be written: before minutes of
    measuring, not after."""
    disk = nvme_dir or Path(tempfile.gettempdir())
    if not disk.is_dir():
        raise UsageError(f"--nvme-dir {disk}: not a directory")
    if not os.access(disk, os.W_OK):
        raise UsageError(f"--nvme-dir {disk}: not writable")
    if out is not None and not os.access(out.parent if str(out.parent) else Path("."), os.W_OK):
        raise UsageError(f"--out {out}: its directory does not exist or is not writable")
    return disk


def _profiles(base: str | None, against: str | None) -> tuple[Cluster | None, Cluster | None]:
    from zbench.plan.simulate.cluster import ClusterError, load

    try:
        return (load(base) if base else None), (load(against) if against else None)
    except ClusterError as exc:
        raise UsageError(str(exc)) from None


def _comparison(earlier: Cluster, now: Cluster) -> Table:
    from rich.table import Table

    from zbench.plan.calibrate.compare import compare

    table = Table(title=f"{earlier.name} -> this calibration")
    for column in ("figure", earlier.name, "now", "now / then"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for d in compare(earlier, now):
        ratio = "" if d.ratio is None else f"{d.ratio:.2f}x"
        table.add_row(
            d.figure,
            "-" if d.first is None else f"{d.first:.4g}",
            "-" if d.second is None else f"{d.second:.4g}",
            ratio,
        )
    return table
