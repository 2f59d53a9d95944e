"""The harness's layering, enforced: import-linter contracts (pyproject.toml) pass, and a planted violation fails.

Also what the packaging promises: the adapters and the engine install as ``zbench.implementations``;
nothing installs or imports a top-level ``implementations`` module.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

#: What an implementation may import from zbench (the protocol and its helpers).
ALLOWED_FOR_IMPLEMENTATIONS = {
    "zbench.protocol",
    "zbench.values",
    "zbench.presets",
    "zbench.state_bytes",
    "zbench.comm_labels",
    "zbench.implementations",
}


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}


def test_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and r.stdout.count("KEPT") == len(contracts())


def test_a_planted_violation_of_each_contract_is_caught(tmp_path):
    """One bad import per rule, in a copy of the package: every contract must report its own."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copytree(ROOT / "zbench", copy / "zbench", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "implementations", copy / "implementations", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    planted = {
        "implementations/ddp.py": "from zbench.store import RunDir  # planted\n",
        "zbench/measure/timing.py": "from zbench import launch  # planted\n",
        "zbench/store.py": "from zbench.report import render  # planted\n",
        "zbench/suite.py": "import torch  # planted\n",
    }
    for path, line in planted.items():
        target = copy / path
        target.write_text(target.read_text() + "\n" + line)
    r = lint_imports(copy)
    assert r.returncode != 0
    for expected in (
        "zbench.implementations.ddp -> zbench.store",
        "zbench.measure.timing -> zbench.launch",
        "zbench.store -> zbench.report",
        "zbench.suite -> torch",
    ):
        assert expected in r.stdout, (expected, r.stdout[-4000:])
    assert r.stdout.count("BROKEN") == len(contracts())


def test_every_zbench_module_is_allowed_or_forbidden_for_implementations():
    """A new harness module must be placed explicitly, so the implementations contract cannot silently go stale."""
    modules = {f"zbench.{p.stem}" for p in (ROOT / "zbench").glob("*.py") if p.stem not in ("__init__", "__main__")}
    modules |= {f"zbench.{p.name}" for p in (ROOT / "zbench").iterdir() if (p / "__init__.py").exists()}
    forbidden = set(contracts()["implementations"]["forbidden_modules"])
    assert modules - ALLOWED_FOR_IMPLEMENTATIONS - forbidden == set()
    assert forbidden <= modules and not forbidden & ALLOWED_FOR_IMPLEMENTATIONS


def test_nothing_imports_a_top_level_implementations_module():
    pattern = re.compile(r"^\s*(from|import)\s+implementations\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("zbench", "implementations", "tests")
        for p in (ROOT / folder).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert offenders == []


@pytest.mark.slow
def test_the_wheel_ships_implementations_inside_zbench(tmp_path):
    source = tmp_path / "src"  # a copy: setuptools builds in the source tree
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "zbench", source / "zbench", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "implementations", source / "implementations", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("zbench-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "zbench/implementations/zero/stage3.py" in names and "zbench/implementations/ddp.py" in names
    assert not [n for n in names if n.startswith("implementations/")]
    assert {"zbench/report/templates/index.html.j2", "zbench/report/static/zbench-report.js"} <= set(names)


#: Fields of the stored records (case, run) that a module might be tempted to look up by string.
RECORD_KEYS = (
    "case_id|config|status|summary|steps|equivalence|memory|model_state|comms|phases|throughput|energy|"
    "time_to_target|params_file|ratio_to_ddp|error|skip_reason|stderr_tail|warnings|suite|environment|"
    "started_at|ended_at|run_id|case_order|git_sha|step_time_s|loss|warmup|equivalent|reason|peak_bytes|"
    "measured_total|expected_total|step_time_median_s|by_op|by_location|per_rank|implementation|"
    "precision|gpus|cpu_count|regression|name"
)


def test_stored_records_are_read_through_their_types():
    """Outside the record modules nobody indexes a stored record by string (``r["status"]``, ``r.get("summary")``)."""
    pattern = re.compile(rf'\["({RECORD_KEYS})"\]|\.get\("({RECORD_KEYS})"')
    typed = {ROOT / "zbench" / "record.py", ROOT / "zbench" / "run_info.py"}
    offenders = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in [*(ROOT / "zbench").rglob("*.py"), *(ROOT / "zbench").rglob("*.j2")]
        if p not in typed and "implementations" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
