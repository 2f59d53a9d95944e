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
    """One bad import per rule, in a copy of the package: every contract must report its own.

    The cycle is planted the way cycles hide: one side under ``TYPE_CHECKING`` (already there: the launcher names
    ``NodeGroup``), the other inside a function.
    """
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copytree(ROOT / "zbench", copy / "zbench", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "implementations", copy / "implementations", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    planted = {
        "implementations/ddp.py": "from zbench.results.store import RunDir  # planted\n",
        "zbench/measure/timing.py": "from zbench.launch import launcher  # planted\n",
        "zbench/results/store.py": "from zbench.report import render  # planted\n",
        "zbench/suite/config.py": "import torch  # planted\n",
        "zbench/values.py": "from zbench.cases import case  # planted\n",
        "zbench/results/export.py": "from zbench.cases.registry import resolve  # planted\n",
        "zbench/launch/nodes.py": "def planted():\n    from zbench.launch.launcher import Launcher\n",
    }
    for path, line in planted.items():
        target = copy / path
        target.write_text(target.read_text() + "\n" + line)
    r = lint_imports(copy)
    assert r.returncode != 0
    for expected in (
        "zbench.implementations.ddp -> zbench.results.store",  # implementations
        "zbench.measure.timing -> zbench.launch.launcher",  # groups (a lower group imports a higher one)
        "zbench.results.store -> zbench.report",  # groups
        "zbench.suite.config -> torch",  # suite
        "zbench.values -> zbench.cases.case",  # foundation
        "zbench.results.export -> zbench.cases.registry",  # records
        "No cycles are allowed in zbench.launch",  # acyclic
    ):
        assert expected in r.stdout, (expected, r.stdout[-4000:])
    assert r.stdout.count("BROKEN") == len(contracts())


def test_every_zbench_module_is_placed_in_the_contracts():
    """A new top-level module or group must be placed explicitly, so no contract can silently go stale: each group
    is a layer, and the foundation's and the implementations' forbidden lists name every group."""
    top = {f"zbench.{p.stem}" for p in (ROOT / "zbench").glob("*.py") if p.stem not in ("__init__", "__main__")}
    groups = {f"zbench.{p.name}" for p in (ROOT / "zbench").iterdir() if (p / "__init__.py").exists()}
    assert groups == set(contracts()["groups"]["layers"])
    entry_points = {"zbench.testing", "zbench.worker"}
    assert top == set(contracts()["foundation"]["source_modules"]) | entry_points
    assert set(contracts()["foundation"]["forbidden_modules"]) == groups | entry_points
    forbidden = set(contracts()["implementations"]["forbidden_modules"])
    assert (top | groups) - {"zbench.implementations"} == (ALLOWED_FOR_IMPLEMENTATIONS | forbidden) - {
        "zbench.implementations"
    }
    assert not forbidden & ALLOWED_FOR_IMPLEMENTATIONS


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
    assert "zbench/cases/hf_configs/llama-3.1-8b.json" in names  # the published architectures travel too


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
    typed = {ROOT / "zbench" / "results" / "record.py", ROOT / "zbench" / "results" / "run_info.py"}
    offenders = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in [*(ROOT / "zbench").rglob("*.py"), *(ROOT / "zbench").rglob("*.j2")]
        if p not in typed and "implementations" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


#: The longest a function of the command line may be: a command parses, calls the harness and prints.
CLI_FUNCTION_MAX_LINES = 60


def function_lengths(folder: Path) -> dict[str, int]:
    """Every function under ``folder`` by ``file:name``, with its length in lines (decorators included)."""
    import ast

    lengths = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                lengths[f"{path.relative_to(folder)}:{node.name}"] = (node.end_lineno or start) - start + 1
    return lengths


def test_every_cli_function_fits_on_a_screen():
    """Each command (and helper) in zbench/cli is at most 60 lines; the rule is measured, so it can fail."""
    lengths = function_lengths(ROOT / "zbench" / "cli")
    assert "run.py:run" in lengths and len(lengths) > 20  # the walk sees the commands
    too_long = {name: n for name, n in lengths.items() if n > CLI_FUNCTION_MAX_LINES}
    assert too_long == {}


def test_the_length_rule_catches_a_long_function(tmp_path):
    long_body = "\n".join(f"    x{i} = {i}" for i in range(CLI_FUNCTION_MAX_LINES))
    (tmp_path / "cmd.py").write_text(f"def command():\n{long_body}\n")
    lengths = function_lengths(tmp_path)
    assert list(lengths.values()) == [CLI_FUNCTION_MAX_LINES + 1]
