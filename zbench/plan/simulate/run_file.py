"""``<run>/simulation.json``: the simulator's step-time prediction stored beside a run, for the report.

``zbench report --simulate`` makes it (``zbench.plan.simulate.measured``); the report shows it whenever it is
there. Kept apart from the simulator so that reading it needs no tracer.
"""

from __future__ import annotations

from pydantic import BaseModel, computed_field

from zbench.results.store import RunDir


class Prediction(BaseModel):
    """One case: its measured median step time next to the simulator's prediction from its trace."""

    case_id: str
    implementation: str
    world: int
    measured_s: float
    predicted_s: float
    comm_s: float

    @computed_field  # type: ignore[prop-decorator]
    @property
    def error(self) -> float:
        """Relative error of the prediction: positive when the simulator says slower than measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


SIMULATION_FILE = "simulation.json"


class RunSimulation(BaseModel):
    """``<run>/simulation.json``: the simulator's prediction beside every case it could predict."""

    schema_version: int = 1
    created_at: str
    method: str
    predictions: list[Prediction]
    not_predicted: dict[str, str]
    median_abs_error: float | None
    worst_abs_error: float | None


def load_simulation(run: RunDir) -> RunSimulation | None:
    """The simulation stored beside ``run``, if one was made (``zbench report --simulate``)."""
    path = run.path / SIMULATION_FILE
    if not path.exists():
        return None
    return RunSimulation.model_validate_json(path.read_bytes())
