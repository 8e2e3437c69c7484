"""Simulated sweeps with a known answer, in memory: each run's final loss is its arm's true loss
at that scale plus normal seed noise (a different SD per arm), the runs built as `Run`s and
compared in-process, so a few hundred sweeps take seconds. The truth: the reference follows
L(C) = E + A C^-alpha and the other arm is worth `MULTIPLIER` times its compute."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nlq_scale.analysis import stats
from nlq_scale.analysis.compare import (
    Comparison, Gap, Options, Trend, arm_gaps, build_cells, compare, gap_trend, improvement_pct,
)
from nlq_scale.analysis.runs import Curve, Run

REFERENCE, ARM = "linear", "nonlinear"
E, A, ALPHA, MULTIPLIER = 2.0, 30.0, 0.12, 1.5
FLOPS_PER_TOKEN = 6_000_000
TOKENS = np.array([1e9, 4e9, 1.6e10, 6.4e10])  # one scale per entry, 4x apart
SCALES = [f"s{i}" for i in range(len(TOKENS))]
SEED_SD = {REFERENCE: 0.003, ARM: 0.010}  # unequal on purpose: Welch, not a pooled SD


def true_loss(arm: str, compute: np.ndarray) -> np.ndarray:
    worth = MULTIPLIER if arm == ARM else 1.0
    return E + A * (worth * compute) ** -ALPHA


@dataclass(frozen=True)
class Truth:
    compute: np.ndarray  # per scale
    gap: np.ndarray  # L_ref - L_arm, nats
    gap_pct: np.ndarray
    slope: float  # least-squares slope of gap_pct on log10 compute: what the trend estimates


def truth() -> Truth:
    compute = FLOPS_PER_TOKEN * TOKENS
    ref, arm = true_loss(REFERENCE, compute), true_loss(ARM, compute)
    pct = improvement_pct(ref, arm)
    return Truth(compute, ref - arm, pct, float(stats.ols_slope(np.log10(compute), pct[None, :])[0]))


def run(arm: str, scale: int, seed: int, loss: float) -> Run:
    tokens = TOKENS[scale]
    curve = Curve(np.array([1000]), np.array([tokens]), np.array([loss]))
    return Run(f"{arm}-{SCALES[scale]}-{seed}", "sim", arm, SCALES[scale], seed, 1e-3, "completed", curve,
               10_000_000, FLOPS_PER_TOKEN)


def sweep(rng: np.random.Generator, seeds: int | dict[str, int]) -> list[Run]:
    """One simulated sweep; `seeds` per arm (one count for both, or one per arm)."""
    per_arm = seeds if isinstance(seeds, dict) else {REFERENCE: seeds, ARM: seeds}
    compute = FLOPS_PER_TOKEN * TOKENS
    return [run(arm, i, s, float(true_loss(arm, compute[i]) + rng.normal(0, SEED_SD[arm])))
            for arm in (REFERENCE, ARM) for i in range(len(TOKENS)) for s in range(per_arm[arm])]


def compared(rng: np.random.Generator, seeds: int | dict[str, int], resamples: int = 200) -> Comparison:
    return compare(sweep(rng, seeds), Options(resamples=resamples, seed=int(rng.integers(2**31))))


def seed_intervals(runs: list[Run], options: Options = Options()) -> tuple[list[Gap], Trend]:
    """The gaps and the trend alone, through the library's own functions: no fit, no bootstrap."""
    cells = build_cells(runs)
    gaps = arm_gaps(cells, REFERENCE, ARM, SCALES, options)
    return gaps, gap_trend(cells, gaps, REFERENCE, ARM, SCALES, options)


def _covers(ci: tuple[float, float] | None, value: float) -> bool:
    return ci is not None and ci[0] <= value <= ci[1]


def coverage(seeds: int, sweeps: int, rng_seed: int = 0, multiplier: bool = False) -> dict[str, float]:
    """The fraction of `sweeps` simulated sweeps whose 95% interval covers the truth, per interval
    (the gap's over every scale). `multiplier`: the whole comparison, fits and bootstrap included
    (slow), for the multiplier's interval too."""
    rng, t = np.random.default_rng(rng_seed), truth()
    hits: dict[str, list[bool]] = {"gap": [], "gap_pct": [], "slope_seeds": [], "slope_residual": [], "multiplier": []}
    for _ in range(sweeps):
        if multiplier:
            comp = compared(rng, seeds)
            gaps, trend = comp.gaps, comp.trends[0]
            hits["multiplier"] += [_covers(m.estimate.ci, MULTIPLIER) for m in comp.multipliers]
        else:
            gaps, trend = seed_intervals(sweep(rng, seeds))
        for i, g in enumerate(gaps):
            hits["gap"].append(_covers(g.improvement.ci, t.gap[i]))
            hits["gap_pct"].append(_covers(g.improvement_pct.ci, t.gap_pct[i]))
        hits["slope_seeds"].append(_covers(trend.ci_seeds, t.slope))
        hits["slope_residual"].append(_covers(trend.ci_residual, t.slope))
    return {name: float(np.mean(h)) for name, h in hits.items() if h}
