"""Operator rates for a GPU no one has calibrated: each traced operator charged from published figures.

A profile ``zbench calibrate`` wrote carries measured tables (``zbench.plan.simulate.calibration``), and
``zbench.plan.simulate.compute`` charges every traced operator from them. A datasheet profile (``h100-sxm``,
``a100-sxm``) has no tables; without ``operators:`` its step is the model's FLOPs at one assumed share of the
peak (``efficiency``), which charges a norm, an activation or a copy as if it were a matrix product. With
``operators:`` each traced operator is charged as a calibrated profile would charge it, from three published
figures: the achievable matrix-product rate per dtype (a microbenchmark such as ml-engineering's maximum
achievable matmul FLOPS, at its best shape), the rate a fused attention kernel reaches (its own published
utilisation: FlashAttention-2 reaches far less of an H100's peak than a plain product does), the achievable
device-memory bandwidth (memory-bound operators), and the host's time to launch one operator (a GPU runs the
larger of an operator's work and its launch).

What it cannot see: matrix products of awkward shapes run slower than the best shape; communication kernels take
processors from the compute they overlap; power caps and clocks below the datasheet's; a newer attention kernel
than the one whose utilisation the profile quotes. Against 46 published runs every prediction was too fast, by
29% (median; docs/data/validate_published.json, docs/methods.md "Against published GPU runs").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from zbench.plan.simulate.calibration import BandwidthPoint, ImplementationOverhead, MatmulPoint


class DatasheetOperators(BaseModel):
    """A profile's ``operators:`` section: the published figures each traced operator is charged from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul_tflops: dict[str, float] = Field(
        description="achievable dense matrix-product rate by dtype (torch's name: bfloat16, float32), 10^12 FLOP/s"
    )
    matmul_shape: tuple[int, int, int] = Field(description="the (m, k, n) the matrix-product rate was measured at")
    attention_tflops: float | None = Field(
        default=None,
        gt=0,
        description="a fused attention kernel's rate (forward and backward), 10^12 FLOP/s; "
        "none: attention at the matrix-product rate",
    )
    memory_gb_s: float = Field(gt=0, description="achievable device-memory bandwidth, bytes read + written, 10^9/s")
    launch_us: float = Field(ge=0, description="host time to launch one operator, microseconds")

    def rates(self, device: str) -> DatasheetRates:
        m, k, n = self.matmul_shape
        return DatasheetRates(
            device=device,
            matmul=[MatmulPoint(m=m, k=k, n=n, dtype=dtype, tflops=t) for dtype, t in self.matmul_tflops.items()],
            memory_bound=[BandwidthPoint(op="copy", bytes=1, gb_s=self.memory_gb_s)],
            op_call_us=self.launch_us,
            attention_tflops=self.attention_tflops,
        )


@dataclass(frozen=True)
class DatasheetRates:
    """The figures ``zbench.plan.simulate.compute`` reads from a calibration, filled from a datasheet: one rate per
    dtype at every size, attention's own rate, one bandwidth, no host mapping cost, no measured implementation
    overheads, no operator factors and no step residuals."""

    device: str
    matmul: list[MatmulPoint]
    memory_bound: list[BandwidthPoint]
    op_call_us: float
    attention_tflops: float | None = None
    mapped_gb_s: float | None = None
    overheads: dict[str, ImplementationOverhead] = field(default_factory=dict)
    operator_factors: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    step_residuals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
