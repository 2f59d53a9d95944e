"""The report's tune page: what ``zbench tune --verify`` searched, pruned and predicted, against what the run
measured. Tune keeps it beside the run as ``tune.json``; a run without one has no tune page."""

from __future__ import annotations

import json
from typing import Any

from zbench.results.store import RunDir

#: The file in a run's directory that holds what tune predicted and what the run measured.
TUNE_FILE = "tune.json"
#: The page's name in the report directory.
TUNE_PAGE = "tune.html"


def load_tune(run: RunDir) -> dict[str, Any] | None:
    """What tune stored beside ``run`` (its search and the verification), or None when tune did not make it."""
    path = run.path / TUNE_FILE
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_bytes())
    return data
