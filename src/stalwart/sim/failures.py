"""Failure processes of a large training job: how often a job of N GPUs is interrupted, and by what.

Why these numbers: the best public record of a frontier run is Llama 3's (The Llama 3 Herd of Models, arXiv
2407.21783, section 3.3.4, Table 5): 16,384 H100 GPUs, 54 days of pre-training, 466 job interruptions of which
419 unexpected, attributed by root cause. The default model is that run's per-GPU rate (419 / (16,384 GPUs x
54 days): one interruption per 5.07e4 GPU-hours, a job MTBF of 3.09 h at 16,384 GPUs) with its mix of causes;
each cause has a recovery class (what a recovery must replace) and a manifestation (does the job see a crash, or
a hang that someone must time out), which are this module's modelling assumptions, not the paper's.

`rsc1` and `rsc2` are the fitted node failure rates of Meta's research clusters (Kokolis et al., "Revisiting
Reliability in Large-Scale Machine Learning Research Clusters", HPCA 2025, arXiv 2410.21680) with the same mix.

Inter-failure times are exponential (a Poisson process for the job), or Weibull per node with shape k (k < 1:
infant mortality, failures cluster early in a node's life) and the same mean, replaced nodes starting new.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOUR = 3600.0
DAY = 24 * HOUR

PROCESS, NODE, SDC = "process", "node", "sdc"
"""Recovery classes: the processes restart on the same hardware; a node is lost and must be replaced; the state
was silently corrupted and must be rolled back past the corruption."""
CRASH, HANG = "crash", "hang"


@dataclass(frozen=True, slots=True)
class Cause:
    name: str
    count: int
    """Interruptions attributed to it in the source."""
    kind: str
    """PROCESS, NODE or SDC."""
    shows_as: str
    """CRASH (a process dies, its peers see a broken connection) or HANG (collectives block until timed out)."""


LLAMA3_CAUSES = (  # Table 5 of arXiv 2407.21783: 419 unexpected interruptions in 54 days on 16,384 H100s
    Cause("faulty GPU", 148, NODE, HANG),
    Cause("GPU HBM3 memory", 72, NODE, CRASH),
    Cause("software bug", 54, PROCESS, CRASH),
    Cause("network switch/cable", 35, NODE, HANG),
    Cause("host maintenance", 32, NODE, CRASH),
    Cause("GPU SRAM memory", 19, NODE, CRASH),
    Cause("GPU system processor", 17, NODE, HANG),
    Cause("NIC", 7, NODE, HANG),
    Cause("NCCL watchdog timeouts", 7, PROCESS, HANG),
    Cause("silent data corruption", 6, SDC, CRASH),
    Cause("GPU thermal interface + sensor", 6, NODE, CRASH),
    Cause("SSD", 3, NODE, CRASH),
    Cause("power supply", 3, NODE, CRASH),
    Cause("server chassis", 2, NODE, CRASH),
    Cause("IO expansion board", 2, NODE, CRASH),
    Cause("dependency", 2, PROCESS, CRASH),
    Cause("CPU", 2, NODE, CRASH),
    Cause("system memory", 2, NODE, CRASH),
)
LLAMA3_GPUS, LLAMA3_DAYS = 16_384, 54
LLAMA3_INTERRUPTIONS = sum(c.count for c in LLAMA3_CAUSES)  # 419

RATES_PER_GPU_HOUR = {
    "llama3": LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_DAYS * 24),
    # Kokolis et al.: failures per 1,000 node-days (8 A100 GPUs a node), RSC-1 6.50 and RSC-2 2.34.
    "rsc1": 6.50 / 1000 / 8 / 24,
    "rsc2": 2.34 / 1000 / 8 / 24,
}
MODELS = tuple(RATES_PER_GPU_HOUR)


@dataclass(frozen=True, slots=True)
class FailureModel:
    name: str
    per_gpu_hour: float
    causes: tuple[Cause, ...] = LLAMA3_CAUSES
    weibull_shape: float | None = None
    """None: exponential (memoryless). Else the shape k of each node's Weibull inter-failure times."""

    @classmethod
    def named(cls, name: str, weibull_shape: float | None = None) -> FailureModel:
        if name not in RATES_PER_GPU_HOUR:
            raise ValueError(f"unknown failure model {name!r} (known: {', '.join(MODELS)})")
        return cls(name, RATES_PER_GPU_HOUR[name], weibull_shape=weibull_shape)

    def job_mtbf_s(self, gpus: int) -> float:
        return HOUR / (self.per_gpu_hour * gpus)

    def probabilities(self) -> np.ndarray:
        counts = np.array([c.count for c in self.causes], dtype=float)
        return counts / counts.sum()

    def sample(
        self, rng: np.random.Generator, runs: int, gpus: int, gpus_per_node: int, horizon_s: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Failure times (runs x F, seconds from the start, sorted, +inf past the last) and their causes (indices
        into `causes`, -1 past the last)."""
        if self.weibull_shape is None:
            times = self._poisson(rng, runs, self.job_mtbf_s(gpus), horizon_s)
        else:
            times = self._weibull(rng, runs, max(1, gpus // gpus_per_node), gpus_per_node, horizon_s)
        causes = rng.choice(len(self.causes), size=times.shape, p=self.probabilities())
        causes[~np.isfinite(times)] = -1
        return times, causes

    @staticmethod
    def _poisson(rng: np.random.Generator, runs: int, mtbf_s: float, horizon_s: float) -> np.ndarray:
        expected = horizon_s / mtbf_s
        width = int(expected + 8 * np.sqrt(expected) + 16)  # the count exceeds this with probability < 1e-12
        times = np.cumsum(rng.exponential(mtbf_s, size=(runs, width)), axis=1)
        times[times > horizon_s] = np.inf
        return times

    def _weibull(
        self, rng: np.random.Generator, runs: int, nodes: int, gpus_per_node: int, horizon_s: float
    ) -> np.ndarray:
        """Each node a renewal process with Weibull(k) gaps of the model's mean (a failed node is replaced by a
        new one), merged."""
        from math import gamma

        k = float(self.weibull_shape or 1.0)
        mean = HOUR / (self.per_gpu_hour * gpus_per_node)
        scale = mean / gamma(1.0 + 1.0 / k)
        per_node = max(4, int(6 * horizon_s / mean) + 4)
        gaps = scale * rng.weibull(k, size=(runs, nodes, per_node))
        times = np.cumsum(gaps, axis=2).reshape(runs, -1)
        times[times > horizon_s] = np.inf
        times.sort(axis=1)
        finite = np.isfinite(times).sum(axis=1).max(initial=0)
        return times[:, : max(1, int(finite))]
