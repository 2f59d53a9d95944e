"""A cluster profile from a calibration: the figures the step-time model reads, derived from the measured tables,
each with its source (``sources``), and the tables kept beside them (``calibration``).

Derivations (each written into the profile's ``sources``):

- ``peak_tflops``: the best measured matrix product at the training precision (bf16 on a GPU, fp32 on a CPU);
- ``efficiency``: the median of the transformer-layer products over that peak. It is an upper bound on a
  step's share of the peak (attention, normalisation and elementwise work run slower than these products);
  only the FLOPs-over-peak model reads it: with a calibrated profile the simulator charges each traced
  operator from the tables instead (``zbench.plan.simulate.compute``);
- links: the collectives' fits. The bus bandwidth is the median of the four collectives' fitted bandwidths,
  the per-hop latency the median of each fit's latency over the hops the step model charges that
  collective (``zbench.plan.calibrate.fit.hops``), so that the model gives the measured latency back; one
  host is one node, so a link between nodes is only known from a base profile (``--base``);
- ``pcie_gb_s``: pinned host-to-device and device-to-host copies, the slower; on a CPU a host memory copy;
- ``nvme_gb_s_per_node``: the disk probe's slower direction;
- ``host_adam_params_per_s``: torch's AdamW on a rank's share of the host cores.
"""

from __future__ import annotations

import statistics
from typing import Any

import yaml

from zbench.errors import UsageError
from zbench.plan.calibrate.fit import hops
from zbench.plan.simulate.calibration import Calibration
from zbench.plan.simulate.cluster import SCHEMA_VERSION, Cluster, Link

TRAINING_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}


def _links(cal: Calibration, base: Cluster | None) -> tuple[Link, Link, dict[str, str]]:
    if not cal.collectives:
        if base is None:
            raise UsageError("one rank here: no collective could be measured; give --base PROFILE for the links")
        why = f"from the base profile {base.name} (one rank here: no collective measured)"
        return base.intra_node, base.inter_node, {"intra_node": why, "inter_node": why}
    # the node's own rank count: curves over more ranks (``--ranks`` repeated; on a CPU, more ranks than cores)
    # serve their own world size (``Cluster.curve``), not the link every other world size is charged by
    node = [c for c in cal.collectives if c.ranks == cal.ranks] or cal.collectives
    bandwidth = statistics.median(c.bandwidth_gb_s for c in node)
    latency = statistics.median(c.latency_us / hops(c.op, c.ranks) for c in node)
    link = Link(bandwidth_gb_s=round(bandwidth, 4), latency_us=round(latency, 2))
    ops = ", ".join(c.op for c in node)
    sources = {
        "intra_node": f"measured: {cal.backend} over {cal.ranks} ranks on this host; median of the alpha-beta fits "
        f"of {ops} (bandwidth; latency per hop)",
    }
    if base is not None:
        sources["inter_node"] = f"from the base profile {base.name} (one host measured)"
        return link, base.inter_node, sources
    sources["inter_node"] = "assumed equal to the node's link (one host measured, no --base given)"
    return link, link, sources


def derive(
    cal: Calibration, *, name: str, gpu: str, memory_gib: float, ranks_per_node: int, base: Cluster | None
) -> Cluster:
    """The profile ``cal`` describes; figures nothing here measured come from ``base``."""
    kind = "cuda" if cal.device != "cpu" else "cpu"
    dtype = TRAINING_DTYPE[kind]
    products = [p for p in cal.matmul if p.dtype == dtype]
    peak = max(p.tflops for p in products)
    layer = [p.tflops for p in products if not p.m == p.k == p.n] or [peak]
    intra, inter, sources = _links(cal, base)
    copy_kind = "pinned host <-> device copies, the slower direction" if kind == "cuda" else "a host memory copy"
    pcie = min(v for k, v in cal.copies_gb_s.items() if "pageable" not in k)
    sources.update(
        peak_tflops=f"measured: the best {dtype} matrix product of {len(products)} shapes",
        efficiency="measured: median transformer-layer product / peak (an upper bound on a step's share)",
        memory_gib="measured: the device's memory" if kind == "cuda" else "measured: host memory / ranks",
        pcie_gb_s=f"measured: {copy_kind}",
        host_adam_params_per_s=f"measured: torch AdamW on {cal.threads_per_rank} thread(s) per rank",
    )
    if cal.disk is not None:
        nvme = min(cal.disk.write_gb_s, cal.disk.read_gb_s)
        sources["nvme_gb_s_per_node"] = f"measured: {cal.disk.directory}, the slower of write (fsync) and read"
    elif base is not None:
        nvme = base.nvme_gb_s_per_node
        sources["nvme_gb_s_per_node"] = f"from the base profile {base.name}"
    else:
        raise UsageError("no disk measured and no --base profile: nothing to put for NVMe")
    if kind == "cpu":
        overlap = 0.0
        sources["overlap"] = "assumed: gloo beside compute on shared cores hides nothing (docs/methods.md#simulation)"
    else:
        overlap = base.overlap if base is not None else 1.0
        sources["overlap"] = f"from the base profile {base.name}" if base is not None else "assumed"
    return Cluster(
        name=name,
        description=f"{gpu}: calibrated on {cal.host} {cal.measured_at} ({cal.ranks} ranks, {cal.backend})",
        gpu=gpu,
        peak_tflops=round(peak, 4),
        memory_gib=round(memory_gib, 1),
        efficiency=round(min(1.0, statistics.median(layer) / peak), 3),
        gpus_per_node=ranks_per_node,
        intra_node=intra,
        inter_node=inter,
        pcie_gb_s=round(pcie, 3),
        nvme_gb_s_per_node=round(nvme, 3),
        host_adam_params_per_s=float(f"{cal.host_adam_params_per_s:.3g}"),
        overlap=overlap,
        schema_version=SCHEMA_VERSION,
        sources=sources,
        calibration=cal,
    )


class _ProfileDumper(yaml.SafeDumper):
    """Block style for the profile's sections, one line per table row (a mapping or list of plain scalars),
    floats to 4 significant digits (more is noise in a measurement)."""


def _flow_if_row(dumper: yaml.SafeDumper, data: dict[str, Any] | list[Any]) -> yaml.Node:
    values = data.values() if isinstance(data, dict) else data
    row = all(isinstance(v, int | float) or (isinstance(v, str) and len(v) <= 24) for v in values)
    if isinstance(data, dict):
        return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=row)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=row)


def _short_float(dumper: yaml.SafeDumper, value: float) -> yaml.Node:
    return dumper.represent_float(float(f"{value:.4g}"))


_ProfileDumper.add_representer(dict, _flow_if_row)
_ProfileDumper.add_representer(list, _flow_if_row)
_ProfileDumper.add_representer(float, _short_float)


def to_yaml(cluster: Cluster) -> str:
    """The profile as YAML, a comment saying how it was made; rows of the tables on one line each."""
    data: dict[str, Any] = cluster.model_dump(mode="json", exclude_none=True)
    header = (
        f"# Written by `zbench calibrate` ({cluster.description}).\n"
        "# `sources` says where each figure comes from; `calibration` holds the measured tables.\n"
        "# One sample of a machine whose speed can drift: compare two calibrations before trusting either.\n"
    )
    return header + yaml.dump(data, Dumper=_ProfileDumper, sort_keys=False, width=120)
