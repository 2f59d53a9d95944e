"""Results out to the tools teams already use: tidy CSV or Parquet tables, or TensorBoard event files.

Two tables, the same ones ``zbench.results.store`` loads into pandas: ``cases`` (one row per run and case: its
configuration, status, step-time summary, ratio to DDP, memory, equivalence) and ``steps`` (one row per
run, case and step: loss, step time, phases, engine metrics, warm-up). TensorBoard gets one run
directory per case (``<out>/<run-id>/<case-id>/``) with each step's scalars and the case's
configuration as text, so runs of a suite compare in TensorBoard's run selector.

Every file is written next to its final name and renamed into place; a TensorBoard run is written to a
temporary directory and moved, so an interrupted export leaves whole files or none.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from zbench.atomic import atomic_write_bytes
from zbench.errors import UsageError
from zbench.results.record import CaseRecord
from zbench.results.store import load_cases, load_steps, run_dirs

if TYPE_CHECKING:
    import pandas as pd

Format = Literal["csv", "parquet", "tensorboard"]
FORMATS: tuple[Format, ...] = ("csv", "parquet", "tensorboard")
#: Each step's values written as TensorBoard scalars (when the step has them), and their tags; the
#: engine's own metrics (grad_norm, loss_scale, ...) follow as ``metrics/<name>``.
STEP_SCALARS = {
    "loss": "loss",
    "step_time_s": "time/step_s",
    "device_step_s": "time/device_step_s",
    "forward_s": "time/forward_s",
    "backward_s": "time/backward_s",
    "optimizer_s": "time/optimizer_s",
}


def _require(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UsageError(f"this export needs the '{module}' package: pip install 'zbench[{extra}]'")


def _write_table(frame: pd.DataFrame, path: Path, fmt: Format) -> None:
    buf = io.BytesIO()
    if fmt == "csv":
        frame.to_csv(buf, index=False)
    else:
        frame.to_parquet(buf, index=False)
    atomic_write_bytes(path, buf.getvalue())


def _write_case_events(case: CaseRecord, log_dir: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(log_dir))
    config = case.config.model_dump_json(indent=1)
    writer.add_text("config", f"status: {case.status}\n\n```\n{config}\n```")
    for sample in case.steps:
        values = sample.model_dump(include=set(STEP_SCALARS))
        scalars = {tag: values[key] for key, tag in STEP_SCALARS.items() if values.get(key) is not None}
        scalars |= {f"metrics/{name}": value for name, value in sample.metrics.items()}
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, global_step=sample.step)
    writer.close()


def _write_tensorboard(results: Path, out: Path, progress: Callable[[str], None]) -> list[Path]:
    """One TensorBoard run per case, each written aside and renamed into place (an old export replaced)."""
    written = []
    for run in run_dirs(results):
        for case in run.cases():
            target = out / run.run_id / case.case_id
            progress(f"tensorboard: {run.run_id}/{case.case_id} ({len(case.steps)} steps)")
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{case.case_id}-"))
            staging.chmod(0o755)  # mkdtemp's 0700 would hide the run from a TensorBoard run by another user
            try:
                _write_case_events(case, staging)
                if target.exists():
                    shutil.rmtree(target)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            written.append(target)
    return written


def export(results: Path, out: Path, fmt: Format, progress: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Write every run under ``results`` to ``out`` in ``fmt``; the paths written."""
    needs = {"parquet": "pyarrow", "tensorboard": "tensorboard"}.get(fmt)
    if needs:
        _require(needs, "export")
    if not any(True for _ in run_dirs(results)):
        raise UsageError(f"{results}: no runs found (expected <dir>/<run-id>/run.json)")
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "tensorboard":
        return _write_tensorboard(results, out, progress)
    paths = []
    for name, frame in {"cases": load_cases(results), "steps": load_steps(results)}.items():
        path = out / f"{name}.{fmt}"
        _write_table(frame, path, fmt)
        progress(f"{path}: {len(frame)} rows")
        paths.append(path)
    return paths
