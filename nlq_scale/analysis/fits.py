"""Scaling-law fits.

- `fit_power_law`: L(x) = E + A * x^(-alpha), x = training compute C or non-embedding params N.
  Variable projection: for a fixed alpha the model is linear in (E, A), so least squares over
  (E, A) is closed form and only alpha is searched (a log-spaced grid refined by one parabolic
  step). The same code fits thousands of bootstrap resamples at once, which keeps CIs cheap.
- `fit_chinchilla`: Hoffmann et al.'s approach 3, L(N, D) = E + A/N^alpha + B/D^beta, fitted as
  a Huber loss (delta = 1e-3) on log L, with L-BFGS-B from a grid of starts (the objective is
  written in log-sum-exp form with an analytic gradient, as in the paper and Epoch AI's
  replication).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize

ALPHA_GRID = np.geomspace(1e-3, 5.0, 1500)
MIN_POINTS = 3  # three parameters


class NotIdentifiable(Exception):
    """The data do not determine the fit; the message says why."""


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = E + A * x^(-alpha)."""

    E: float
    A: float
    alpha: float
    n_points: int
    x_min: float
    x_max: float

    def __call__(self, x: np.ndarray | float) -> np.ndarray | float:
        return self.E + self.A * np.power(x, -self.alpha)

    def inverse(self, loss: float) -> float:
        """The x at which the law reaches `loss`; +inf when loss is at or below the asymptote E."""
        return float(inverse_batch(np.array([self.E]), np.array([self.A]), np.array([self.alpha]), np.array([loss]))[0])

    def as_dict(self) -> dict:
        return asdict(self)


def fit_power_law(x: np.ndarray, y: np.ndarray) -> PowerLaw:
    """Least-squares L(x) = E + A x^-alpha through points (x, y); raises NotIdentifiable."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    _check_points(x)
    E, A, alpha, ok = fit_power_law_batch(x, y[None, :])
    if not ok[0]:
        raise NotIdentifiable(_failure_reason(x, y))
    return PowerLaw(float(E[0]), float(A[0]), float(alpha[0]), len(x), float(x.min()), float(x.max()))


def _check_points(x: np.ndarray) -> None:
    distinct = len(np.unique(x))
    if distinct < MIN_POINTS:
        raise NotIdentifiable(
            f"{distinct} distinct point(s); E + A*x^-alpha has 3 parameters and needs at least {MIN_POINTS}"
        )
    if np.any(~np.isfinite(x)) or np.any(x <= 0):
        raise NotIdentifiable("x must be positive and finite at every point")


def _failure_reason(x: np.ndarray, y: np.ndarray) -> str:
    E, A, alpha = _profile(x, y[None, :])
    if A[0] <= 0:
        return "loss does not decrease with x (best fit has A <= 0)"
    return f"best alpha sits on the search bound ({alpha[0]:.3g}); the curvature is not determined"


def fit_power_law_batch(x: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fit every row of Y (shape B x k) against the shared x (k,). Returns E, A, alpha and an `ok`
    mask (False where the best alpha is on the grid's edge or the curve is not decreasing)."""
    E, A, alpha = _profile(x, Y)
    edge = (alpha <= ALPHA_GRID[1]) | (alpha >= ALPHA_GRID[-2])
    return E, A, alpha, (A > 0) & ~edge & np.isfinite(E)


def _profile(x: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x0 = np.exp(np.log(x).mean())  # work in x/x0 so A stays O(loss) whatever the units of x
    u = np.log(ALPHA_GRID)
    sse = _sse(x / x0, Y, ALPHA_GRID)  # (B, G)
    i = np.clip(sse.argmin(axis=1), 1, len(u) - 2)
    rows = np.arange(len(Y))
    # one parabolic step in log alpha through the grid minimum and its neighbours
    f0, f1, f2 = sse[rows, i - 1], sse[rows, i], sse[rows, i + 1]
    h = u[1] - u[0]
    denom = f0 - 2 * f1 + f2
    shift = np.where(denom > 0, 0.5 * h * (f0 - f2) / np.where(denom > 0, denom, 1.0), 0.0)
    alpha = np.exp(u[i] + np.clip(shift, -h, h))
    E, A_scaled = _linear_part(x / x0, Y, alpha)
    return E, A_scaled * np.power(x0, alpha), alpha


def _sse(xs: np.ndarray, Y: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    Z = np.power(xs[None, :], -alphas[:, None])  # (G, k)
    Zc = Z - Z.mean(axis=1, keepdims=True)
    Yc = Y - Y.mean(axis=1, keepdims=True)
    szz = np.einsum("gk,gk->g", Zc, Zc)
    szy = Yc @ Zc.T  # (B, G)
    syy = np.einsum("bk,bk->b", Yc, Yc)
    return syy[:, None] - szy**2 / szz[None, :]


def _linear_part(xs: np.ndarray, Y: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares (E, A) of each row of Y given its own alpha."""
    Z = np.power(xs[None, :], -alpha[:, None])  # (B, k)
    Zm, Ym = Z.mean(axis=1, keepdims=True), Y.mean(axis=1, keepdims=True)
    A = ((Z - Zm) * (Y - Ym)).sum(axis=1) / ((Z - Zm) ** 2).sum(axis=1)
    return Ym[:, 0] - A * Zm[:, 0], A


def inverse_batch(E: np.ndarray, A: np.ndarray, alpha: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """x where each fitted law reaches its loss; +inf where the loss is at or below E."""
    gap = loss - E
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x = np.power(A / np.where(gap > 0, gap, np.nan), 1.0 / alpha)
    return np.where(gap > 0, x, np.inf)


# ---------------------------------------------------------------------------------------------
# Chinchilla approach 3

HUBER_DELTA = 1e-3
# starts for (a = log A, b = log B, e = log E, alpha, beta); a small grid reaches the same optimum
# as Hoffmann et al.'s 4500-start grid on the Chinchilla data (tests/test_analysis_fits.py).
DEFAULT_STARTS = tuple(itertools.product((0.0, 10.0, 20.0), (0.0, 10.0, 20.0), (0.0,), (0.3, 1.0), (0.3, 1.0)))


@dataclass(frozen=True)
class ChinchillaFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float  # summed Huber loss at the optimum
    n_points: int

    def __call__(self, N: np.ndarray, D: np.ndarray) -> np.ndarray:
        return self.E + self.A / np.power(N, self.alpha) + self.B / np.power(D, self.beta)

    @property
    def raw(self) -> np.ndarray:
        return np.array([np.log(self.A), np.log(self.B), np.log(self.E), self.alpha, self.beta])

    def as_dict(self) -> dict:
        return asdict(self)


def _huber_objective(p: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, delta: float):
    a, b, e, alpha, beta = p
    terms = np.stack([a - alpha * logN, b - beta * logD, np.full_like(logN, e)])
    top = terms.max(axis=0)
    lse = top + np.log(np.exp(terms - top).sum(axis=0))  # plain numpy: scipy's logsumexp costs 4x more here
    r = lse - logL
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    dr = np.where(small, r, delta * np.sign(r))
    w = dr * np.exp(terms - lse)  # d lse / d term = softmax weight
    grad = np.array([w[0].sum(), w[1].sum(), w[2].sum(), -(w[0] * logN).sum(), -(w[1] * logD).sum()])
    return value, grad


def _minimize(start, logN, logD, logL, delta):
    return minimize(
        _huber_objective,
        np.asarray(start, float),
        args=(logN, logD, logL, delta),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 10000, "ftol": 1e-15, "gtol": 1e-12},
    )


def fit_chinchilla(
    N: np.ndarray,
    D: np.ndarray,
    L: np.ndarray,
    delta: float = HUBER_DELTA,
    starts: tuple[tuple[float, ...], ...] = DEFAULT_STARTS,
) -> ChinchillaFit:
    N, D, L = (np.asarray(v, float) for v in (N, D, L))
    if len(L) < 5:
        raise NotIdentifiable(f"{len(L)} point(s); L(N, D) has 5 parameters")
    if np.any(N <= 0) or np.any(D <= 0) or np.any(L <= 0):
        raise NotIdentifiable("params, tokens and loss must be positive")
    logs = np.log(N), np.log(D), np.log(L)
    best = min((_minimize(s, *logs, delta) for s in starts), key=lambda r: r.fun)
    return _chinchilla_from_raw(best.x, best.fun, len(L))


def _chinchilla_from_raw(x: np.ndarray, fun: float, n: int) -> ChinchillaFit:
    a, b, e, alpha, beta = x
    return ChinchillaFit(float(np.exp(e)), float(np.exp(a)), float(np.exp(b)), float(alpha), float(beta), float(fun), n)


def bootstrap_chinchilla(
    N: np.ndarray,
    D: np.ndarray,
    L: np.ndarray,
    fit: ChinchillaFit,
    resamples: int,
    seed: int,
    delta: float = HUBER_DELTA,
) -> list[ChinchillaFit]:
    """Refits on points resampled with replacement, each started from the full-data optimum."""
    rng = np.random.default_rng(seed)
    logs = np.log(np.asarray(N, float)), np.log(np.asarray(D, float)), np.log(np.asarray(L, float))
    out = []
    for _ in range(resamples):
        idx = rng.integers(0, len(L), size=len(L))
        r = _minimize(fit.raw, *(v[idx] for v in logs), delta)
        out.append(_chinchilla_from_raw(r.x, r.fun, len(L)))
    return out
