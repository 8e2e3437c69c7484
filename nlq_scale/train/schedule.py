"""Learning-rate schedules as pure functions of the step, so a resumed run needs only the step."""

from __future__ import annotations

import math

from nlq_scale.config.schema import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine / linear / WSD decay to
    lr * min_lr_ratio at the last step."""
    peak, floor = t.lr, t.lr * t.min_lr_ratio
    if step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_schedule == "cosine":
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    if t.lr_schedule == "linear":
        return peak + (floor - peak) * progress
    # WSD: constant at peak, then a linear decay over the final wsd_decay_fraction of training.
    decay_start = 1.0 - t.wsd_decay_fraction
    if progress <= decay_start:
        return peak
    return peak + (floor - peak) * (progress - decay_start) / t.wsd_decay_fraction
