"""Divergence guard: a non-finite loss, or val loss above its best by `margin` for `patience`
evaluations in a row."""

from __future__ import annotations

import math

from nlq_scale.config.schema import DivergenceConfig


class DivergenceGuard:
    def __init__(self, cfg: DivergenceConfig) -> None:
        self.cfg = cfg
        self.best = math.inf
        self.strikes = 0

    def check_train(self, loss: float) -> str | None:
        return None if math.isfinite(loss) else f"non-finite training loss ({loss})"

    def check_val(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"non-finite validation loss ({loss})"
        if loss > self.best + self.cfg.margin:
            self.strikes += 1
            if self.strikes >= self.cfg.patience:
                return f"val loss {loss:.4f} above best {self.best:.4f} + {self.cfg.margin} for {self.strikes} evals"
        else:
            self.strikes = 0
        self.best = min(self.best, loss)
        return None

    def state_dict(self) -> dict:
        return {"best": self.best, "strikes": self.strikes}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.strikes = state["best"], state["strikes"]
