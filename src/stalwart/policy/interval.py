"""How often to checkpoint, from the cost of one checkpoint and the rate of failures: the classical optima.

Why: a checkpoint every tau seconds of work costs C / tau of the time in stalls; a failure costs, besides the
restart, the work since the last checkpoint (tau / 2 on average). The sum is smallest near sqrt(2 * C * M) for a
mean time between failures M (Young, 1974); Daly (2006) refined it for C not small against M and for the restart
time. Both are in use in HPC schedulers; the simulator (sim/) checks its own optimum against them, and the
adaptive policy uses Daly's with C and M measured.

All times in seconds; `mtbf_s` is the whole job's mean time between interruptions (a node's MTBF divided by the
number of nodes, for independent nodes).
"""

from __future__ import annotations

import math


def young(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 * C * M).

    J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974."""
    _check(checkpoint_s, mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints:

        sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + (C / (2 M)) / 9) - C    for C < 2 M,  else M.

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future Generation
    Computer Systems 22(3), 2006, eq. (37) (also LLNL SCR's scr_ckpt_interval.py). His figures: with a 5-minute
    dump, 117 min at M = 24 h, 57 min at 6 h, 9.1 min at 15 min; this gives 116.7, 56.7 and 9.14."""
    _check(checkpoint_s, mtbf_s)
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


def expected_waste(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """The fraction of wall time that is not useful work, for exponential failures, a checkpoint of C after every
    `interval_s` of work, and `restart_s` lost per failure besides the redone work (Daly's complete model):

        T_wall / T_work = M * exp(R / M) * (exp((tau + C) / M) - 1) / tau

    The simulator's result converges to this; its minimum over tau is Daly's optimum to second order."""
    _check(checkpoint_s, mtbf_s)
    if interval_s <= 0:
        raise ValueError(f"interval must be positive, got {interval_s}")
    ratio = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s) / interval_s
    return 1.0 - 1.0 / ratio


def availability_optimal(checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """The interval that maximises availability (Saxena, Hukerikar, Blaz, Raj, "Optimal Checkpoint Interval with
    Availability as an Objective Function", arXiv 2410.18124):  T_c = T_s + sqrt(2 (T_f + T_r) T_s + T_s^2)."""
    _check(checkpoint_s, mtbf_s)
    return checkpoint_s + math.sqrt(2.0 * (mtbf_s + restart_s) * checkpoint_s + checkpoint_s**2)


def optimum_by_search(checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """The interval that minimises `expected_waste` (golden-section search): the exact optimum Daly's formula
    approximates."""
    lo, hi = 1e-6 * mtbf_s, 10.0 * mtbf_s
    lo, hi = math.log(lo), math.log(hi)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa = expected_waste(math.exp(a), checkpoint_s, mtbf_s, restart_s)
    fb = expected_waste(math.exp(b), checkpoint_s, mtbf_s, restart_s)
    for _ in range(200):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = expected_waste(math.exp(a), checkpoint_s, mtbf_s, restart_s)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = expected_waste(math.exp(b), checkpoint_s, mtbf_s, restart_s)
    return math.exp((lo + hi) / 2.0)


def _check(checkpoint_s: float, mtbf_s: float) -> None:
    if not (checkpoint_s > 0 and mtbf_s > 0 and math.isfinite(checkpoint_s) and math.isfinite(mtbf_s)):
        raise ValueError(f"checkpoint cost and MTBF must be positive, got {checkpoint_s} and {mtbf_s}")
