"""`nlq-scale design SWEEP --pilot ROOT`: the seeds a sweep's comparisons need, from pilot runs. The
seed spread of the final loss is measured per scale on the pilot (pooled over its arms), its trend
with non-embedding parameters N fitted as a line in log-log and carried to the sweep's rungs, and
at each rung: the seeds per arm that resolve the gap, the smallest gap the sweep's own seeds
resolve, and the GPU-hours from `plan`'s cost model."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from nlq_scale.analysis import power, stats
from nlq_scale.analysis.compare import Options, build_cells, judge, pooled_sd
from nlq_scale.analysis.runs import Run
from nlq_scale.cluster.plan import PlannedRun
from nlq_scale.errors import UsageError
from nlq_scale.model.accounting import count_parameters


@dataclass(frozen=True)
class PilotSpread:
    """The seed SD of the final loss at one pilot scale, pooled over its cells with 2+ seeds."""

    scale: str
    params: int
    sd: float
    dof: int  # sum of (seeds - 1) over the pooled cells


@dataclass(frozen=True)
class SpreadLaw:
    """log SD = a + b log N over the pilot scales: constant (b = 0) with one scale; no interval below 3."""

    a: float
    b: float
    points: tuple[PilotSpread, ...]
    note: str

    def at(self, params: float, level: float) -> tuple[float, tuple[float, float] | None]:
        """The SD at N = params and its interval (of the line's mean, t with k - 2 dof), extrapolated as drawn."""
        logn = math.log(params)
        sd = math.exp(self.a + self.b * logn)
        k = len(self.points)
        if k < 3:
            return sd, None
        x = np.log([p.params for p in self.points])
        y = np.log([p.sd for p in self.points])
        resid = y - (self.a + self.b * x)
        s2 = float(resid @ resid) / (k - 2)
        se = math.sqrt(s2 * (1 / k + (logn - x.mean()) ** 2 / float(((x - x.mean()) ** 2).sum())))
        half = float(sps.t.ppf(0.5 + level / 2, k - 2)) * se
        return sd, (sd * math.exp(-half), sd * math.exp(half))


@dataclass(frozen=True)
class Rung:
    scale: str
    params: int
    seeds: int  # the sweep's seeds per arm at one learning rate
    sd: float
    sd_ci: tuple[float, float] | None
    seeds_needed: int | None  # per arm, to resolve the gap (None without one)
    detectable: float | None  # the smallest gap (nats) the sweep's seeds resolve at the target power; None at 1 seed
    gpu_hours_per_seed: float  # one seed more at every arm and learning rate of the rung
    gpu_hours_sweep: float  # the rung as the sweep plans it
    gpu_hours_needed: float | None  # the rung at seeds_needed


def pilot_spreads(runs: list[Run]) -> list[PilotSpread]:
    """Per scale with a cell of 2+ seeds and a known N, smallest N first."""
    included = [v.run for v in (judge(r, Options()) for r in runs) if v.included]
    by_scale = defaultdict(list)
    for cell in build_cells(included).values():
        if cell.n >= 2 and cell.params:
            by_scale[cell.scale].append(cell)
    out = []
    for scale, cells in by_scale.items():
        dof = sum(c.n - 1 for c in cells)
        out.append(PilotSpread(scale, int(np.median([c.params for c in cells])), pooled_sd(cells), dof))
    if not out:
        raise UsageError("--pilot: no completed arm x scale cell with 2 or more seeds and a known N: no seed spread "
                         "to measure")
    return sorted(out, key=lambda p: p.params)


def spread_law(points: list[PilotSpread]) -> SpreadLaw:
    logn = np.log([p.params for p in points])
    logsd = np.log([p.sd for p in points])
    if len(set(logn)) < 2 or not np.all(np.isfinite(logsd)):
        # one N (or seeds that agree): nothing to draw a line through
        return SpreadLaw(float(np.log(np.mean([p.sd for p in points]))), 0.0, tuple(points),
                         "one pilot scale (or seeds that agree): the SD is taken as constant in N")
    b = float(stats.ols_slope(logn, logsd[None, :])[0])
    note = "two pilot scales: the line has no interval" if len(points) == 2 else ""
    return SpreadLaw(float(logsd.mean() - b * logn.mean()), b, tuple(points), note)


def rungs(planned: list[PlannedRun], law: SpreadLaw, gap: float | None, target: float, level: float) -> list[Rung]:
    out = []
    for scale in dict.fromkeys(r.spec.scale for r in planned):
        here = [r for r in planned if r.spec.scale == scale]
        seeds = len({r.spec.seed for r in here})
        params = count_parameters(here[0].cfg.model).non_embedding
        sd, sd_ci = law.at(params, level)
        hours = sum(r.plan.gpu_hours for r in here)
        per_seed = hours / seeds
        needed = None if gap is None else power.seeds_per_arm(gap, sd, target, level)
        detectable = power.detectable_gap(sd, seeds, seeds, target, level) if seeds >= 2 else None
        out.append(Rung(scale, params, seeds, sd, sd_ci, needed, detectable, per_seed, hours,
                        None if needed is None else needed * per_seed))
    return out


def as_dict(sweep: str, cluster: str, law: SpreadLaw, rows: list[Rung], args) -> dict:
    return {
        "sweep": sweep, "cluster": cluster, "pilot": args.pilot, "gap": args.gap, "power": args.power,
        "level": args.level,
        "pilot_spread": [{"scale": p.scale, "params": p.params, "sd": p.sd, "dof": p.dof} for p in law.points],
        "spread_law": {"log_sd": f"{law.a:.6g} + {law.b:.6g} log N", "exponent": law.b, "note": law.note},
        "rungs": [{"scale": r.scale, "params": r.params, "seeds": r.seeds, "sd": r.sd,
                   "sd_ci": None if r.sd_ci is None else list(r.sd_ci), "seeds_per_arm": r.seeds_needed,
                   "detectable_gap": r.detectable, "gpu_hours_per_seed": round(r.gpu_hours_per_seed, 4),
                   "gpu_hours_sweep": round(r.gpu_hours_sweep, 4),
                   "gpu_hours_needed": None if r.gpu_hours_needed is None else round(r.gpu_hours_needed, 4)}
                  for r in rows],
        "gpu_hours_sweep": round(sum(r.gpu_hours_sweep for r in rows), 4),
        "gpu_hours_needed": None if args.gap is None else round(sum(r.gpu_hours_needed for r in rows), 4),
    }


def _fmt(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def table(doc: dict) -> str:
    spread = ", ".join(f"{p['scale']} (N {p['params']:,}) {p['sd']:.4g} over {p['dof']} dof" for p in doc["pilot_spread"])
    law = doc["spread_law"]
    lines = [f"pilot seed SD: {spread}",
             f"SD(N): log SD = {law['log_sd']}" + (f" ({law['note']})" if law["note"] else ""),
             f"sweep {doc['sweep']} on {doc['cluster']}, power {doc['power']:g} at {doc['level']:.0%}"
             + (f", gap {doc['gap']:g} nats" if doc["gap"] is not None else ""),
             "scale        N  seed SD [interval]          seeds  resolves above  seeds/arm for gap  GPU-h sweep  GPU-h design"]
    for r in doc["rungs"]:
        ci = "" if r["sd_ci"] is None else f" [{r['sd_ci'][0]:.3g}, {r['sd_ci'][1]:.3g}]"
        lines.append(f"{r['scale']:<6}{r['params']:>9.3g}  {r['sd']:.3g}{ci:<22}  {r['seeds']:>5}  "
                     f"{_fmt(r['detectable_gap'], '.4f'):>14}  {_fmt(r['seeds_per_arm'], 'd'):>17}  "
                     f"{r['gpu_hours_sweep']:>11.1f}  {_fmt(r['gpu_hours_needed'], '.1f'):>12}")
    needed = f", at the design's seeds {doc['gpu_hours_needed']:.1f}" if doc["gpu_hours_needed"] is not None else ""
    lines.append(f"GPU-hours: the sweep as planned {doc['gpu_hours_sweep']:.1f}{needed}")
    return "\n".join(lines)
