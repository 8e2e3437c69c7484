"""Divergence and loss-spike detection on a run's validation curve.

A run diverged when a loss went non-finite (val or train), when the train loop's own guard said so,
or when its val loss rose above its running best by more than `margin` and never came back
(a blow-up). An excursion above best + margin that comes back within the margin is a spike: listed,
but the run keeps counting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nlq_scale.analysis.runs import Run


@dataclass(frozen=True)
class Divergence:
    kind: str  # "non-finite" | "blow-up" | "reported" (the train loop's guard / status)
    step: int


def excursions(loss: np.ndarray, margin: float) -> list[tuple[int, int]]:
    """[start, end) index ranges where the loss sits above its running best by more than margin."""
    above = loss > np.minimum.accumulate(loss) + margin
    edges = np.flatnonzero(np.diff(np.concatenate([[0], above.astype(int), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def detect_divergence(run: Run, margin: float) -> Divergence | None:
    found: list[Divergence] = []
    loss, steps = run.val.loss, run.val.step
    n_finite = _finite_prefix(loss)
    if n_finite < len(loss):
        found.append(Divergence("non-finite", int(steps[n_finite])))
    if run.first_nonfinite_train_step is not None:
        found.append(Divergence("non-finite", run.first_nonfinite_train_step))
    if run.diverged_event_step is not None or run.state == "diverged":
        step = run.diverged_event_step if run.diverged_event_step is not None else _last_step(run)
        found.append(Divergence("reported", step))
    spans = excursions(loss[:n_finite], margin)
    if spans and spans[-1][1] == n_finite:
        found.append(Divergence("blow-up", int(steps[spans[-1][0]])))
    return min(found, key=lambda d: d.step) if found else None


def detect_spikes(run: Run, margin: float) -> list[int]:
    """Steps where recovered spikes began (excursions that ended before the curve did)."""
    n_finite = _finite_prefix(run.val.loss)
    spans = excursions(run.val.loss[:n_finite], margin)
    return [int(run.val.step[a]) for a, b in spans if b < n_finite]


def _finite_prefix(loss: np.ndarray) -> int:
    """How many leading evaluations are finite."""
    bad = np.flatnonzero(~np.isfinite(loss))
    return int(bad[0]) if bad.size else len(loss)


def _last_step(run: Run) -> int:
    return run.final_step if run.has_val else 0
