"""Per arm x scale statistics, gaps to the reference arm, scaling fits, compute multipliers and the
trend of the gap with scale. The gaps and the trend's seed interval are Welch-Satterthwaite t
intervals of a (linearised) weighted sum of cell means, calibrated at every seed count. The fits
and the multiplier, which go through a fitted law, come from one joint bootstrap over seeds: each
arm x scale cell's seeds are resampled (fixed-seed numpy Generator) and every fit is recomputed
from the same resampled cell means, so the report is reproducible; those intervals are not
calibrated and say so. docs/analysis.md explains each number and its assumptions."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

from nlq_scale.analysis import fits, power, stats
from nlq_scale.analysis.divergence import Divergence, detect_divergence, detect_spikes
from nlq_scale.analysis.lr import LrOptimum, LrScaling, lr_optimum, lr_scaling
from nlq_scale.analysis.runs import Run
from nlq_scale.arms import baseline
from nlq_scale.errors import UsageError

Axis = Literal["compute", "params"]
DEFAULT_REFERENCE = baseline().name
MIN_SEEDS_FOR_CI = 2
# the simulation of docs/analysis.md ("Coverage") measures these intervals' coverage off 95%
UNCALIBRATED = "seed bootstrap through a fitted law: not calibrated (docs/analysis.md, Coverage)"
DETECT_POWER = 0.8  # the power at which the report states the smallest gap a comparison's seeds resolve


@dataclass(frozen=True)
class Options:
    reference: str | None = None
    resamples: int = 2000
    seed: int = 0
    level: float = 0.95
    include_incomplete: bool = False
    divergence_margin: float = 0.5
    trend_axis: Axis = "compute"


@dataclass(frozen=True)
class RunVerdict:
    run: Run
    included: bool
    reason: str  # why excluded, "" when included
    divergence: Divergence | None
    spikes: list[int]


def seed_mean(losses: np.ndarray) -> float:
    """The mean final loss over seeds, inside the seeds' min..max: the sum's rounding can put the mean of
    seeds that agree an ulp outside their own range (50 seeds at 3.95: mean - min = -9e-16), which
    the report's min..max error bars cannot draw."""
    return float(np.clip(losses.mean(), losses.min(), losses.max()))


@dataclass(frozen=True)
class LrPoint:
    lr: float | None
    losses: np.ndarray  # final loss per seed

    @property
    def mean(self) -> float:
        return seed_mean(self.losses)

    @property
    def n(self) -> int:
        return len(self.losses)


@dataclass
class Cell:
    """One arm at one scale, at that arm's best learning rate there."""

    arm: str
    scale: str
    best_lr: float | None
    lr_grid: list[LrPoint]
    runs: list[Run]
    losses: np.ndarray
    boot: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0))  # resampled means

    @property
    def n(self) -> int:
        return len(self.losses)

    @property
    def mean(self) -> float:
        return seed_mean(self.losses)

    @property
    def std(self) -> float | None:
        return float(self.losses.std(ddof=1)) if self.n > 1 else None

    @property
    def variance(self) -> float:
        """The seeds' sample variance, 0 where they agree (an ulp of rounding is no seed noise)."""
        return float(self.losses.var(ddof=1)) if self.losses.max() > self.losses.min() else 0.0

    @property
    def compute(self) -> float | None:
        values = [r.compute for r in self.runs]
        return None if any(v is None for v in values) else float(np.mean(values))

    @property
    def params(self) -> int | None:
        values = {r.params for r in self.runs}
        return values.pop() if len(values) == 1 else None

    def axis_value(self, axis: Axis) -> float | None:
        """The cell's place on a log axis; None where unknown or zero (runs whose last evaluation is at step 0)."""
        value = self.compute if axis == "compute" else self.params
        return float(value) if value else None


@dataclass(frozen=True)
class Estimate:
    """A statistic with its bootstrap interval; `ci` is None when it cannot be estimated (`note` says why)."""

    value: float | None
    ci: tuple[float, float] | None = None
    note: str = ""
    resamples: int | None = None  # how many bootstrap resamples the interval rests on


@dataclass(frozen=True)
class Gap:
    arm: str
    scale: str
    improvement: Estimate  # L_ref - L_arm in nats; positive = the arm is better
    improvement_pct: Estimate  # 100 (L_ref - L_arm) / L_ref
    n_arm: int
    n_ref: int
    sd: float | None = None  # the two cells' pooled seed SD; None with a one-seed cell
    level: float = 0.95

    @cached_property  # on demand: a root of the noncentral t's power, which simulations of the intervals skip
    def detectable(self) -> float | None:
        """The smallest true gap (nats) these seeds, at their pooled measured spread, resolve with DETECT_POWER."""
        return None if self.sd is None else power.detectable_gap(self.sd, self.n_arm, self.n_ref, DETECT_POWER,
                                                                 self.level)


@dataclass(frozen=True)
class ArmFit:
    arm: str
    axis: Axis
    law: fits.PowerLaw | None
    note: str  # why not identifiable, or caveats
    alpha: Estimate | None = None
    E: Estimate | None = None
    objective: float | None = None  # sum of squared residuals at the optimum
    flags: tuple[str, ...] = ()  # why the points do not determine the law although one was fitted

    @property
    def statement(self) -> str:
        return "not identifiable from these points: " + "; ".join(self.flags) + "." if self.flags else ""


@dataclass(frozen=True)
class Multiplier:
    arm: str
    scale: str
    estimate: Estimate  # C_ref / C_arm at equal loss
    extrapolated: bool

    @property
    def separated(self) -> bool | None:
        """Whether the interval excludes 1 (the arms' compute efficiencies differ); None without one."""
        ci = self.estimate.ci
        return None if ci is None else bool(ci[0] > 1 or ci[1] < 1)


@dataclass(frozen=True)
class Trend:
    arm: str
    axis: Axis
    n_scales: int
    slope: float | None  # improvement percentage points per 10x of the axis
    ci_seeds: tuple[float, float] | None  # Welch-Satterthwaite: seed noise within the cells
    ci_residual: tuple[float, float] | None
    distinguishable: bool | None
    note: str
    # the slope (percentage points per 10x) that would move the gap by its own mean size across
    # these scales: an interval inside +-this is narrow enough to call the gap steady
    steady_bound: float | None = None

    @property
    def narrow(self) -> bool:
        cis = [ci for ci in (self.ci_seeds, self.ci_residual) if ci is not None]
        return bool(cis) and self.steady_bound is not None and all(
            -self.steady_bound <= lo and hi <= self.steady_bound for lo, hi in cis)


@dataclass(frozen=True)
class Downstream:
    """One arm x scale cell's mean accuracy on one `nlq-scale eval` task metric, over the seeds that
    have it, next to the cell's loss and compute."""

    arm: str
    scale: str
    metric: str  # task/metric, e.g. nlq_cloze/acc
    n_seeds: int
    accuracy: Estimate  # seed mean with its bootstrap interval
    loss: float
    compute: float | None


@dataclass
class Comparison:
    options: Options
    reference: str
    verdicts: list[RunVerdict]
    scales: list[str]
    cells: dict[tuple[str, str], Cell]
    gaps: list[Gap]
    fits: list[ArmFit]
    multipliers: list[Multiplier]
    trends: list[Trend]
    lr_optima: list[LrOptimum]
    lr_laws: list[LrScaling]
    downstream: list[Downstream] = field(default_factory=list)

    @property
    def arms(self) -> list[str]:
        return reference_first(self.cells, self.reference)


def reference_first(cells: dict[tuple[str, str], Cell], reference: str) -> list[str]:
    return [reference, *sorted({arm for arm, _ in cells} - {reference})]


# ---------------------------------------------------------------------------------------------
# entry point


def compare(runs: list[Run], options: Options) -> Comparison:
    verdicts = [judge(r, options) for r in runs]
    included = [v.run for v in verdicts if v.included]
    if not included:
        states = ", ".join(sorted({f"{v.run.state}" for v in verdicts}))
        raise UsageError(
            f"no run can be compared: {len(runs)} run(s) found (states: {states}), none completed with a finite "
            "val/loss (see --include-incomplete)"
        )
    cells = build_cells(included)
    reference = choose_reference(options.reference, {arm for arm, _ in cells})
    rng = np.random.default_rng(options.seed)
    for key in sorted(cells):
        cells[key].boot = stats.resample_means(cells[key].losses, options.resamples, rng, options.level)
    scales = order_scales(cells)
    arms = reference_first(cells, reference)
    others = arms[1:]
    gaps = [g for arm in others for g in arm_gaps(cells, reference, arm, scales, options)]
    arm_fits = [fit_arm(cells, arm, scales, axis, options) for arm in arms for axis in ("compute", "params")]
    ref_fit = arm_fits[0]  # the reference, on compute
    multipliers = [m for arm in others for m in compute_multipliers(cells, ref_fit, arm, scales, options)]
    trends = [gap_trend(cells, gaps, reference, arm, scales, options) for arm in others]
    optima = [lr_optimum(cells[(a, s)], options.resamples, rng, options.level)
              for s in scales for a in arms if (a, s) in cells]  # fmt: skip
    lr_laws = [lr_scaling(optima, arm) for arm in arms]
    downstream = downstream_cells(cells, scales, arms, options)
    return Comparison(options, reference, verdicts, scales, cells, gaps, arm_fits, multipliers, trends, optima, lr_laws,
                      downstream)  # fmt: skip


def downstream_cells(cells: dict[tuple[str, str], Cell], scales: list[str], arms: list[str],
                     options: Options) -> list[Downstream]:  # fmt: skip
    """Mean accuracy per arm x scale x task metric with a bootstrap interval over seeds. Its own
    generator (same seed): eval results never move the loss statistics' intervals."""
    rng = np.random.default_rng(options.seed)
    out = []
    for scale in scales:
        for arm in arms:
            cell = cells.get((arm, scale))
            if cell is None:
                continue
            for metric in sorted({m for r in cell.runs for m in r.downstream}):
                values = np.array([r.downstream[metric] for r in cell.runs if metric in r.downstream])
                out.append(Downstream(arm, scale, metric, len(values), _accuracy(values, rng, options),
                                      cell.mean, cell.compute))  # fmt: skip
    return out


def _accuracy(values: np.ndarray, rng: np.random.Generator, options: Options) -> Estimate:
    if len(values) < MIN_SEEDS_FOR_CI:
        return Estimate(float(values.mean()), None, f"{len(values)} seed: no interval")
    boot = stats.resample_means(values, options.resamples, rng, options.level)
    return Estimate(float(values.mean()), stats.percentile_ci(boot, options.level), resamples=options.resamples)


def judge(run: Run, options: Options) -> RunVerdict:
    divergence = detect_divergence(run, options.divergence_margin)
    spikes = detect_spikes(run, options.divergence_margin)
    if not run.has_val:
        if run.state == "completed":
            raise UsageError(f"{run.source}: completed run has no val/loss records")
        return RunVerdict(run, False, f"no val/loss (state {run.state})", divergence, spikes)
    if divergence is not None:
        return RunVerdict(run, False, f"diverged ({divergence.kind} at step {divergence.step})", divergence, spikes)
    if run.state != "completed" and not options.include_incomplete:
        return RunVerdict(run, False, f"state {run.state} (--include-incomplete to use it)", None, spikes)
    return RunVerdict(run, True, "", None, spikes)


def choose_reference(requested: str | None, arms: set[str]) -> str:
    if requested is not None:
        if requested not in arms:
            raise UsageError(f"--reference {requested!r}: no compared runs have that arm (arms: {', '.join(sorted(arms))})")
        return requested
    return DEFAULT_REFERENCE if DEFAULT_REFERENCE in arms else sorted(arms)[0]


# ---------------------------------------------------------------------------------------------
# cells: arm x scale at the arm's best learning rate


def build_cells(runs: list[Run]) -> dict[tuple[str, str], Cell]:
    groups: dict[tuple[str, str], dict[float | None, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        groups[(run.arm, run.scale)][run.lr].append(run)
    return {key: best_lr_cell(*key, by_lr) for key, by_lr in groups.items()}


def best_lr_cell(arm: str, scale: str, by_lr: dict[float | None, list[Run]]) -> Cell:
    """Each arm is compared at its own best learning rate: the lowest mean final loss over seeds."""
    grid = [
        LrPoint(lr, np.array([r.final_loss for r in rs]))
        for lr, rs in sorted(by_lr.items(), key=lambda kv: (kv[0] is None, kv[0] or 0.0))
    ]
    best = min(grid, key=lambda p: p.mean)
    chosen = sorted(by_lr[best.lr], key=lambda r: r.seed)
    return Cell(arm, scale, best.lr, grid, chosen, np.array([r.final_loss for r in chosen]))


def order_scales(cells: dict[tuple[str, str], Cell]) -> list[str]:
    """Smallest first: by median compute, then params, then name."""
    by_scale: dict[str, list[Cell]] = defaultdict(list)
    for (_, scale), cell in cells.items():
        by_scale[scale].append(cell)

    def key(scale: str) -> tuple[float, float, str]:
        c = [x.compute for x in by_scale[scale] if x.compute is not None]
        p = [x.params for x in by_scale[scale] if x.params is not None]
        return (float(np.median(c)) if c else math.inf, float(np.median(p)) if p else math.inf, scale)

    return sorted(by_scale, key=key)


def _seed_note(cells: list[Cell]) -> str:
    few = [f"{c.arm}@{c.scale}" for c in cells if c.n < MIN_SEEDS_FOR_CI]
    if not few:
        return ""
    return f"no CI: needs >= {MIN_SEEDS_FOR_CI} seeds per cell to resample, only 1 in {', '.join(few)}"


# ---------------------------------------------------------------------------------------------
# gaps


def arm_gaps(cells, reference: str, arm: str, scales: list[str], options: Options) -> list[Gap]:
    out = []
    for scale in scales:
        if (arm, scale) not in cells or (reference, scale) not in cells:
            continue
        x, r = cells[(arm, scale)], cells[(reference, scale)]
        note = _seed_note([x, r])

        def estimate(value: float, weighted: list[tuple[float, Cell]]) -> Estimate:
            return Estimate(value, None, note) if note else Estimate(value, seed_ci(value, weighted, options.level))

        absolute = estimate(r.mean - x.mean, [(1.0, r), (-1.0, x)])
        relative = estimate(improvement_pct(r.mean, x.mean), pct_weights(x, r))
        out.append(Gap(arm, scale, absolute, relative, x.n, r.n, None if note else pooled_sd([x, r]), options.level))
    return out


def pooled_sd(cells: list[Cell]) -> float:
    """The cells' seed spread pooled over their sum(n - 1) degrees of freedom (each cell 2+ seeds)."""
    return math.sqrt(sum((c.n - 1) * c.variance for c in cells) / sum(c.n - 1 for c in cells))


def seed_ci(value: float, weighted: list[tuple[float, Cell]], level: float) -> tuple[float, float]:
    """The Welch-Satterthwaite interval of a statistic that is, to first order, sum(w * cell mean)."""
    w = np.array([w for w, _ in weighted])
    variances = np.array([c.variance for _, c in weighted])
    counts = np.array([c.n for _, c in weighted], dtype=float)
    return stats.welch_ci(value, w, variances, counts, level)


def pct_weights(arm: Cell, ref: Cell) -> list[tuple[float, Cell]]:
    """The gradient of 100 (L_ref - L_arm) / L_ref in the two cell means (the delta method: the
    seeds move L_ref by a thousandth of itself, so the ratio is linear over that range)."""
    return [(100 * arm.mean / ref.mean**2, ref), (-100 / ref.mean, arm)]


def boot_estimate(value: float | None, samples: np.ndarray, level: float, note: str = "") -> Estimate:
    """An estimate whose interval rests on the resamples that gave a number (NaN marks a dropped one)."""
    return Estimate(value, stats.percentile_ci(samples, level), note, int((~np.isnan(samples)).sum()))


def improvement_pct(ref_loss, arm_loss):
    """100 (L_ref - L_arm) / L_ref: positive when the arm's loss is lower. Works on arrays too."""
    return 100 * (ref_loss - arm_loss) / ref_loss


# ---------------------------------------------------------------------------------------------
# fits and compute multipliers


def _axis_points(cells, arm: str, scales: list[str], axis: Axis) -> tuple[list[Cell], str]:
    """The arm's cells that have a value on the axis, and a note naming the ones that do not."""
    mine = [cells[(arm, s)] for s in scales if (arm, s) in cells]
    usable = [c for c in mine if c.axis_value(axis) is not None]
    missing = [c.scale for c in mine if c.axis_value(axis) is None]
    return usable, (f"{axis} unknown or zero at {', '.join(missing)}" if missing else "")


def fit_arm(cells, arm: str, scales: list[str], axis: Axis, options: Options) -> ArmFit:
    usable, missing = _axis_points(cells, arm, scales, axis)
    x = np.array([c.axis_value(axis) for c in usable])
    y = np.array([c.mean for c in usable])
    try:
        law = fits.fit_power_law(x, y)
    except fits.NotIdentifiable as e:
        return ArmFit(arm, axis, None, join_notes(f"not identifiable: {e}", missing))
    exact = "3 points for 3 parameters: exact interpolation, no residual check" if len(usable) == 3 else ""
    note = join_notes(missing, exact)
    objective = float(((law(x) - y) ** 2).sum())
    flags = fits.power_law_flags(x, y, law, options.level)
    seed_note = _seed_note(usable)
    if seed_note:
        alpha_est, E_est = Estimate(law.alpha, None, seed_note), Estimate(law.E, None, seed_note)
        return ArmFit(arm, axis, law, note, alpha_est, E_est, objective, tuple(flags))
    E, _, alpha, ok = _refits(usable, axis)
    fail = join_notes(_failure_note(ok), UNCALIBRATED)
    alpha_est = boot_estimate(law.alpha, np.where(ok, alpha, np.nan), options.level, fail)
    E_est = boot_estimate(law.E, np.where(ok, E, np.nan), options.level, fail)
    if E_est.ci is not None and E_est.ci[0] < fits.E_FLOOR * y.min() and law.E >= fits.E_FLOOR * y.min():
        # the seeds' noise alone moves the asymptote onto its bound: the points do not pin it down
        flags.append(f"E's {options.level:.0%} interval [{E_est.ci[0]:.3g}, {E_est.ci[1]:.3g}] reaches its bound 0")
    return ArmFit(arm, axis, law, note, alpha_est, E_est, objective, tuple(flags))


def join_notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _failure_note(ok: np.ndarray) -> str:
    failed = int((~ok).sum())
    return f"{failed}/{ok.size} resamples gave no identifiable fit and were dropped" if failed else ""


def compute_multipliers(cells, ref_fit: ArmFit, arm: str, scales: list[str], options: Options) -> list[Multiplier]:
    """C_ref / C_arm: how much more (or less) compute the reference needs to reach the arm's loss,
    read off the reference's fitted L(C) at the arm's observed mean loss."""
    out = []
    ref_cells, _ = _axis_points(cells, ref_fit.arm, scales, "compute")
    ref_boot = _refits(ref_cells, "compute") if ref_fit.law is not None and not _seed_note(ref_cells) else None
    for scale in scales:
        cell = cells.get((arm, scale))
        if cell is None:
            continue
        if ref_fit.law is None:
            out.append(Multiplier(arm, scale, Estimate(None, None, f"reference fit {ref_fit.note}"), False))
            continue
        if cell.axis_value("compute") is None:
            out.append(Multiplier(arm, scale, Estimate(None, None, f"compute unknown or zero for {arm}@{scale}"), False))
            continue
        c_ref = ref_fit.law.inverse(cell.mean)
        value = c_ref / cell.compute
        extrapolated = not (ref_fit.law.x_min <= c_ref <= ref_fit.law.x_max)
        estimate = _multiplier_estimate(value, cell, ref_cells, ref_fit, ref_boot, options)
        out.append(Multiplier(arm, scale, estimate, extrapolated))
    return out


def _refits(cells: list[Cell], axis: Axis) -> tuple[np.ndarray, ...]:
    """(E, A, alpha, ok) of the power law refitted on every bootstrap resample of these cells."""
    x = np.array([c.axis_value(axis) for c in cells])
    return fits.fit_power_law_batch(x, np.stack([c.boot for c in cells], axis=1))


def _multiplier_estimate(value: float, cell: Cell, ref_cells: list[Cell], ref_fit: ArmFit,
                         ref_boot: tuple[np.ndarray, ...] | None, options: Options) -> Estimate:  # fmt: skip
    """The interval is over seeds and fits: every resample of the seeds refits the reference's law
    (`ref_boot`, once for every scale) and reads it at that resample's arm loss."""
    beyond = "the arm's loss is below the reference fit's asymptote E" if math.isinf(value) else ""
    shaky = f"reference fit {ref_fit.statement}" if ref_fit.flags else ""
    seed_note = _seed_note([cell, *ref_cells])
    if seed_note or ref_boot is None:
        return Estimate(_finite_or_none(value), None, join_notes(beyond, shaky, seed_note))
    E, A, alpha, ok = ref_boot
    boot = np.where(ok, fits.inverse_batch(E, A, alpha, cell.boot) / cell.compute, np.nan)
    note = join_notes(beyond, shaky, _failure_note(ok), UNCALIBRATED)
    return boot_estimate(_finite_or_none(value), boot, options.level, note)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------
# trend of the gap with scale


def _too_few_for_slope(at: list[float], axis: Axis) -> str:
    """Why no line can be fitted through the scales at these axis values; "" when one can."""
    if len(at) < 2:
        return f"{len(at)} scale(s) with a gap and a known {axis}; a slope needs 2"
    if len(set(at)) < 2:
        return f"{len(at)} scales with a gap, all at the same {axis}; a slope needs 2 different ones"
    return ""


def gap_trend(cells, gaps: list[Gap], reference: str, arm: str, scales: list[str], options: Options) -> Trend:
    """Regress the relative improvement (percentage points) on log10 of the reference's compute or
    params at each scale. Two intervals: the seeds' (Welch-Satterthwaite over every cell the slope
    is a weighted sum of: noise within cells) and, with 3+ scales, the residual t-interval (also
    catches curvature the line does not follow). The slope counts as
    distinguishable from zero only if every available interval excludes zero."""
    axis = options.trend_axis
    mine = [g for g in gaps if g.arm == arm]
    pairs = [(cells[(arm, g.scale)], cells[(reference, g.scale)]) for g in mine]
    usable = [(x, r) for x, r in pairs if r.axis_value(axis) is not None]
    why = _too_few_for_slope([r.axis_value(axis) for _, r in usable], axis)
    if why:
        return Trend(arm, axis, len(usable), None, None, None, None, why)
    logx = np.log10([r.axis_value(axis) for _, r in usable])
    pct = np.array([improvement_pct(r.mean, x.mean) for x, r in usable])
    slope = float(stats.ols_slope(logx, pct[None, :])[0])
    seed_note = _seed_note([c for pair in usable for c in pair])
    ci_seeds = None if seed_note else seed_ci(slope, _slope_weights(logx, usable), options.level)
    ci_resid = stats.ols_slope_ci(logx, pct, options.level)
    verdicts = [stats.excludes_zero(ci) for ci in (ci_seeds, ci_resid) if ci is not None]
    distinguishable = all(verdicts) if verdicts else None
    two = "2 scales: the line passes through both points, so lack of fit cannot be checked" if ci_resid is None else ""
    steady = float(abs(pct.mean()) / (logx.max() - logx.min()))
    return Trend(arm, axis, len(usable), slope, ci_seeds, ci_resid, distinguishable, join_notes(seed_note, two),
                 steady)


def _slope_weights(logx: np.ndarray, pairs: list[tuple[Cell, Cell]]) -> list[tuple[float, Cell]]:
    """The least-squares slope is sum_i c_i pct_i with c = centred x / its sum of squares; each
    pct_i is linear in its two cells (pct_weights), so the slope is a weighted sum of cell means."""
    xc = logx - logx.mean()
    c = xc / (xc @ xc)
    return [(ci * w, cell) for ci, (x, r) in zip(c, pairs) for w, cell in pct_weights(x, r)]
