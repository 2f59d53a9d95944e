"""GPU memory, utilisation, power and energy from nvml, sampled by a background thread on each rank.

The sampler reads this rank's GPU every ``interval_s`` (default 50 ms) and
keeps the timeline; energy comes from the GPU's total-energy counter where it
has one (Volta and later), else from integrating power. Where nvml or a GPU is
absent the sampler reports itself unavailable instead of failing.

``mark()`` notes the energy counter when the timed steps begin, so energy per
step covers the timed steps only: on the H100 the first steps of a 12-step case
(CUDA and cuBLAS initialisation, the optimizer's first allocation) tripled a
whole-run average (88 J/step against 31 J for the same kind of step).
"""

from __future__ import annotations

import itertools
import threading
import time


class NvmlSampler:
    def __init__(self, device_index: int, interval_s: float = 0.05) -> None:
        self.device_index = device_index
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, float]] = []  # (t, used bytes, util %, power W)
        self.unavailable: str | None = None
        self._energy_start_mj: int | None = None
        self._energy_end_mj: int | None = None
        self._mark: tuple[float, int | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None

    def start(self) -> NvmlSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as exc:  # no library, no driver, no such GPU
            self.unavailable = f"{type(exc).__name__}: {exc}"
            return self
        self._energy_start_mj = self._energy_mj()
        self._thread = threading.Thread(target=self._run, name="zbench-nvml", daemon=True)
        self._thread.start()
        return self

    def _energy_mj(self) -> int | None:
        import pynvml

        try:
            return pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except Exception:
            return None

    def _sample(self) -> None:
        import pynvml

        mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
        power = pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
        self.samples.append((time.monotonic(), mem.used, util, power))

    def mark(self) -> None:
        """The timed steps start now: energy since here is reported as ``energy_timed_j``."""
        if self._handle is not None:
            self._mark = (time.monotonic(), self._energy_mj())

    def _energy_between(self, start_mj: int | None, end_mj: int | None, since: float) -> float | None:
        if start_mj is not None and end_mj is not None:
            return (end_mj - start_mj) / 1000.0
        s = [x for x in self.samples if x[0] >= since]
        return sum((b[0] - a[0]) * a[3] for a, b in itertools.pairwise(s)) if len(s) > 1 else None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as exc:  # a GPU that falls off the bus must not kill training
                self.unavailable = f"sampling stopped: {exc}"
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> dict:
        """Stop sampling and summarise: peak memory used, mean utilisation and power, energy in joules."""
        if self.unavailable and self._thread is None:
            return {"available": False, "reason": self.unavailable}
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._energy_end_mj = self._energy_mj()
        try:
            import pynvml

            pynvml.nvmlShutdown()
        except Exception:
            pass
        s = self.samples
        energy = self._energy_between(self._energy_start_mj, self._energy_end_mj, since=0.0)
        timed = (
            self._energy_between(self._mark[1], self._energy_end_mj, since=self._mark[0])
            if self._mark is not None
            else None
        )
        return {
            "available": True,
            "interval_s": self.interval_s,
            "samples": len(s),
            "peak_used_bytes": max((x[1] for x in s), default=None),
            "mean_utilization_pct": sum(x[2] for x in s) / len(s) if s else None,
            "mean_power_w": sum(x[3] for x in s) / len(s) if s else None,
            "energy_j": energy,
            "energy_timed_j": timed,
            "energy_source": "counter" if self._energy_end_mj is not None else "power integral",
            "timeline": [
                [round(t - s[0][0], 3), used, util, round(p, 1)] for t, used, util, p in s[:: max(1, len(s) // 200)]
            ],
        }
