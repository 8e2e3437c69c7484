"""The two-phase learning-rate search of a sweep with `lr_search: {strategy: proxy, width: W}`.

Phase 1 trains, per scale and arm, the sweep's LR grid on a proxy W wide (plan.proxy_config: the
target's depth, head dim, batch, sequence length and tokens; muP with W as its base width), one seed.
Phase 2, once every proxy run of a (scale, arm) completed, fits eta* to their final val losses
(analysis.lr: a parabola in log LR around the minimum) and trains the target under muP with base
width W, where eta* transfers: every seed at eta*, and the first seed at eta* times and divided by
the grid's step, which confirms the optimum. An optimum on the grid's edge submits nothing for that
(scale, arm): its grid must be extended.

`submit` asks `due_runs` what to consider each time it runs: the proxies always (finished ones are
skipped as usual) and the targets of the groups whose proxies finished. With the local executor it
goes on to phase 2 itself; on SLURM it queues a small job, after the proxy jobs, that runs the same
`submit` again (`FollowUp`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nlq_scale.cluster.sweep import RunSpec, SweepConfig, run_id_for
from nlq_scale.config.load import build_run_config
from nlq_scale.errors import UsageError


def _groups(grid: list[RunSpec]) -> dict[tuple[str, str], list[RunSpec]]:
    groups: dict[tuple[str, str], list[RunSpec]] = {}
    for spec in grid:
        groups.setdefault((spec.scale, spec.arm), []).append(spec)
    return groups


def proxy_spec(point: RunSpec, width: int) -> RunSpec:
    from nlq_scale.cluster.plan import proxy_config

    cfg = proxy_config(point.cfg, width)
    return RunSpec(point.sweep, cfg.name, point.scale, point.arm, point.seed, point.lr, cfg)


def final_val_loss(run_dir: Path) -> float | None:
    """The last val/loss of a completed run, +inf for a diverged one (its LR is too high); None for
    any other (still to run, running, failed)."""
    from nlq_scale.train.rundir import last_record, read_status

    state = read_status(run_dir).get("state")
    if state == "diverged":
        return math.inf
    if state != "completed":
        return None
    return last_record(run_dir, "val/loss", tail_bytes=None).get("val/loss")


def target_spec(point: RunSpec, width: int, seed: int, lr: float) -> RunSpec:
    """The grid point's run under muP with base width `width`, at `seed` and `lr`."""
    raw = point.cfg.model_dump(mode="json")
    raw["model"].update(parametrization="mup", mup_base_hidden_size=width)
    raw["seed"], raw["train"]["lr"] = seed, lr
    raw["name"] = run_id_for(point.scale, point.arm, seed, lr)
    cfg = build_run_config(raw, f"the eta* run {raw['name']}")
    return RunSpec(point.sweep, cfg.name, point.scale, point.arm, seed, lr, cfg)


def grid_step(lrs: list[float]) -> float:
    """The grid's geometric step (mean ratio of neighbouring LRs)."""
    logs = np.log(sorted(lrs))
    return float(math.exp(np.diff(logs).mean()))


def due_runs(sweep: SweepConfig, grid: list[RunSpec], root: Path) -> tuple[list[RunSpec], list[str]]:
    """The runs to submit now, and one line per (scale, arm) whose targets cannot be submitted yet (why)."""
    from nlq_scale.analysis.compare import LrPoint
    from nlq_scale.analysis.lr import grid_optimum

    width = sweep.lr_search.width
    assert width is not None  # LrSearch validates it
    specs, waiting = [], []
    for (scale, arm), points in _groups(grid).items():
        first_seed = [p for p in points if p.seed == sweep.seeds[0]]
        if len(first_seed) < 3:
            raise UsageError(f"sweep {sweep.name}: lr_search proxy: arm {arm} has {len(first_seed)} learning rate(s); "
                             "give lrs (3 or more) to fit an optimum")
        proxies = [proxy_spec(p, width) for p in first_seed]
        specs += proxies
        losses = [final_val_loss(p.run_dir(root)) for p in proxies]
        done = sum(v is not None for v in losses)
        if done < len(proxies):
            waiting.append(f"{scale}/{arm}: {done} of {len(proxies)} proxy runs ended (completed or diverged)")
            continue
        # Diverged LRs leave the fit: an optimum next to them is then on the fitted grid's edge.
        grid_points = [LrPoint(p.lr, np.array([v])) for p, v in zip(proxies, losses) if math.isfinite(v)]
        best = grid_optimum(arm, scale, None, grid_points, 0, np.random.default_rng(0), 0.95)
        if best.edge or len(grid_points) < 3:
            waiting.append(f"{scale}/{arm}: the proxies' best LR {best.lr:g} is on the edge of the "
                           f"{len(grid_points)} that did not diverge: extend lrs")
            continue
        step = grid_step([p.lr for p in first_seed])
        anchor = first_seed[0]
        specs += [target_spec(anchor, width, seed, best.lr) for seed in sweep.seeds]
        specs += [target_spec(anchor, width, sweep.seeds[0], best.lr * f) for f in (1 / step, step)]
    return specs, waiting


@dataclass(frozen=True)
class FollowUp:
    """A SLURM job that runs `nlq-scale ARGV` (the same submit) once the proxy jobs ended."""

    argv: list[str]

    def __call__(self) -> int:
        from nlq_scale.cli import main

        return main(self.argv)


def report_waiting(waiting: list[str]) -> None:
    for line in waiting:
        print(f"lr search: {line}", file=sys.stderr)
