"""``zbench list``: the implementations, model presets and suites zbench knows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from zbench.cli.options import stdout


def list_cmd(
    suites: Annotated[Path, typer.Option(help="Where to look for suite files.")] = Path("suites"),
) -> None:
    """Implementations, model presets and suites zbench knows."""
    out = stdout()
    out.print(_implementations())
    out.print("Your own: name it in a suite as 'package.module:attribute' (see zbench.protocol).\n")
    out.print(_models())
    out.print(_suites(suites))


def _implementations() -> Table:
    from zbench.cases import registry
    from zbench.implementations import BUILTIN

    table = Table(title="implementations")
    for col in ("name", "stages", "precisions", "offload", "source"):
        table.add_column(col)
    for name, target in BUILTIN.items():
        try:
            caps = registry.resolve(name).capabilities
        except LookupError as exc:
            table.add_row(name, "-", "-", "-", f"unavailable: {exc}")
            continue
        stages = ",".join(map(str, sorted(caps.stages)))
        table.add_row(name, stages, ",".join(sorted(caps.precisions)), ",".join(sorted(caps.offload)), target)
    return table


def _models() -> Table:
    from zbench.cases import hf_models
    from zbench.presets import PRESETS

    table = Table(title="models (the published architectures need the hf extra: pip install 'zbench\\[hf]')")
    for col in ("name", "architecture", "parameters", "layers", "d_model", "heads (kv)", "vocab", "seq"):
        table.add_column(col)
    for name, cfg in PRESETS.items():
        shape = (cfg.layers, cfg.d_model, cfg.heads, cfg.vocab, cfg.seq)
        table.add_row(name, "gpt", f"{cfg.num_parameters:,}", *map(str, shape))
    for name, arch in hf_models.published().items():
        kind = arch.model_type + (f" {arch.experts}x top-{arch.experts_per_token}" if arch.experts else "")
        heads = f"{arch.heads} ({arch.kv_heads})"
        seq = f"{arch.train_seq_len} of {arch.max_positions}"
        table.add_row(name, kind, f"{arch.num_parameters:,}", str(arch.layers), str(arch.d_model), heads,
                      str(arch.vocab), seq)  # fmt: skip
    return table


def _suites(folder: Path) -> Table:
    import yaml

    table = Table(title=f"suites in {folder}/")
    table.add_column("file")
    table.add_column("description")
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        try:
            data = yaml.safe_load(path.read_text()) or {}
            desc = data.get("description", "") if isinstance(data, dict) else ""
        except yaml.YAMLError:
            desc = "(malformed YAML)"
        table.add_row(str(path), str(desc).strip())
    return table
