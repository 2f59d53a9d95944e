"""What changed since the last runs of the same suite on the same machine: the report's "base -> new" view.

The comparison is ``zbench check``'s own (``zbench.verdicts.regress.check`` against the suite's
``baseline_runs`` newest earlier runs, with the suite's thresholds), so the report
colours exactly what the gate would fail or praise; the cells show the newest
baseline run's figures next to this run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zbench.results.record import CaseRecord
from zbench.results.store import RunDir
from zbench.verdicts.regress import CheckResult, Finding, check, latest_baselines, thresholds_for

TIME_METRICS = ("step_time_vs_ddp", "step_time")
MEMORY_METRICS = ("peak_memory", "model_state")


@dataclass
class Baseline:
    run_ids: list[str]
    """The earlier runs compared against, newest first."""
    result: CheckResult
    records: dict[str, CaseRecord] = field(default_factory=dict)
    """The newest baseline run's record of each case."""

    def findings(self, case_id: str) -> list[Finding]:
        return [f for f in self.result.findings if f.case_id == case_id]

    def change(self, case_id: str, metrics: tuple[str, ...]) -> str | None:
        """``regression``, ``improvement`` or ``failure`` for this case's metrics beyond the thresholds, else None."""
        kinds = {f.kind for f in self.findings(case_id) if f.metric in metrics or f.kind == "failure"}
        for kind in ("failure", "regression", "improvement"):
            if kind in kinds:
                return kind
        return None

    @property
    def listed(self) -> list[Finding]:
        """Regressions, failures and improvements, worst first; the reference's drift is not a change of a case."""
        order = {"failure": 0, "regression": 1, "improvement": 2}
        return sorted(
            (f for f in self.result.findings if f.kind in order),
            key=lambda f: (order[f.kind], -abs(f.change_pct or 0)),
        )


def baseline_for(run: RunDir, results_root: Path | None) -> Baseline | None:
    """The comparison with the earlier runs under ``results_root``, or None when there are none."""
    if results_root is None:
        return None
    thresholds = thresholds_for(run)
    earlier = latest_baselines(results_root, run, thresholds.baseline_runs)
    if not earlier:
        return None
    result = check(run, earlier, thresholds)
    return Baseline([r.run_id for r in earlier], result, {r.case_id: r for r in earlier[0].cases()})
